"""Every request counted and timed, by route template and status (`esk_http_requests_total`,
`esk_http_request_seconds`): ASGI middleware outside the routing, so that a request no
route took (a 404, a missing bearer token) is counted too, under `unrouted`."""

from __future__ import annotations

import time

from starlette.types import Message, Receive, Scope, Send

from ..metrics import HTTP_REQUEST_SECONDS, HTTP_REQUESTS
from .route import RequestWatcher, route_of

UNROUTED = "unrouted"
# The server takes methods the API has no route for (WebDAV's, and more): one of those is
# counted under OTHER, so that a client cannot add series at will.
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
OTHER = "other"


class RequestMetrics(RequestWatcher):
    async def watch(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = time.perf_counter()
        status = 500  # what the server answers when the app fails before it starts an answer

        async def send_counted(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_counted)
        finally:
            method = scope["method"] if scope["method"] in METHODS else OTHER
            route = route_of(scope) or UNROUTED
            HTTP_REQUESTS.labels(method, route, str(status)).inc()
            HTTP_REQUEST_SECONDS.labels(method, route).observe(time.perf_counter() - started)
