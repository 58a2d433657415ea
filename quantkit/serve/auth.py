"""Bearer API keys, as a plain ASGI middleware (BaseHTTPMiddleware would hide client disconnects)."""

from __future__ import annotations

import hmac
import json

from quantkit.serve.errors import error_body


class APIKeyMiddleware:
    """401 unless `Authorization: Bearer <key>` names one of `keys`; `public_paths` need no key.

    `public_paths` is a set the app owns, so later routers (metrics, readiness) can add theirs.
    """

    def __init__(self, app, keys: tuple[str, ...], public_paths: set[str]):
        self.app, self.keys, self.public_paths = app, tuple(k.encode() for k in keys), public_paths

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not self.keys or scope["path"] in self.public_paths \
                or scope.get("method") == "OPTIONS":
            return await self.app(scope, receive, send)
        header = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        if scheme.lower() == b"bearer" and any(hmac.compare_digest(token.strip(), k) for k in self.keys):
            return await self.app(scope, receive, send)
        body = json.dumps(error_body(401, "invalid or missing API key (send Authorization: Bearer <key>)")).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
