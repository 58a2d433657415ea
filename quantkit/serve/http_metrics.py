"""An ASGI middleware that times every HTTP request into `http_requests_total` /
`http_request_duration_seconds`, labelled by the route's template (never the raw path, so label values
stay bounded), method and status. The time runs to the end of the response body (a whole stream)."""

from __future__ import annotations

import time

from quantkit.serve.metrics import ServerMetrics


class HTTPMetricsMiddleware:
    def __init__(self, app, metrics: ServerMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status = time.perf_counter(), [500]  # an app that raises before answering: a 500

        async def send_status(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            route = getattr(scope.get("route"), "path", None) or "unmatched"
            self.metrics.observe_http(route, scope.get("method", ""), status[0], time.perf_counter() - start)
