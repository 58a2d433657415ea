"""Bearer API keys and per-key limits, as a plain ASGI middleware (BaseHTTPMiddleware would hide client
disconnects).

Every path but the public ones needs a key (401 otherwise). Requests to the generation endpoints (POST
under /v1/) also pass the key's limits (429 with Retry-After, see keyring.py); while one runs, its lease is
`current_lease`, so the engine front charges the tokens it used to that key when it ends.
"""

from __future__ import annotations

import contextvars
import json
import logging

from quantkit.serve.errors import error_body
from quantkit.serve.keyring import KeyRing, Lease, RateLimited, fingerprint

log = logging.getLogger("quantkit.serve")
current_lease: contextvars.ContextVar[Lease | None] = contextvars.ContextVar("current_lease", default=None)


class APIKeyMiddleware:
    """`public_paths` is a set the app owns, so later routers (metrics, readiness) can add theirs.
    `on_reject(reason)` is told of every refusal (the metrics' rejection counter)."""

    def __init__(self, app, ring: KeyRing, public_paths: set[str], on_reject=lambda reason: None):
        self.app, self.ring, self.public_paths, self.on_reject = app, ring, public_paths, on_reject

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not self.ring.enabled or route_path(scope) in self.public_paths \
                or scope.get("method") == "OPTIONS":
            return await self.app(scope, receive, send)
        header = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
        key = self.ring.authenticate(header)
        if key is None:
            given = header.partition(" ")[2].strip()
            log.info("401 %s %s: %s", scope.get("method"), scope["path"],
                     f"unknown key {fingerprint(given)}" if given else "no key")
            self.on_reject("unauthorized")
            body = error_body(401, "invalid or missing API key (send Authorization: Bearer <key>)")
            return await _send_json(send, 401, body, {"www-authenticate": "Bearer"})
        if not (scope.get("method") == "POST" and route_path(scope).startswith("/v1/")):
            return await self.app(scope, receive, send)
        try:
            lease = self.ring.admit(key)
        except RateLimited as exc:
            log.info("429 for key %s: %s", key.name, exc.limit)
            self.on_reject(exc.limit)
            return await _send_json(send, 429, exc.body(), {"retry-after": exc.retry_after_header})
        token = current_lease.set(lease)
        try:
            await self.app(scope, receive, send)
        finally:
            current_lease.reset(token)
            lease.release()


def route_path(scope) -> str:
    """The path the routes see: behind --root-path uvicorn puts the prefix in front of every path (the ASGI
    spec's `path` includes `root_path`), which routing takes off again."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root):] or "/" if root and path.startswith(root) else path


async def _send_json(send, status: int, body: dict, headers: dict[str, str]) -> None:
    raw = json.dumps(body).encode()
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
    head += [(k.encode(), v.encode()) for k, v in headers.items()]
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": raw})
