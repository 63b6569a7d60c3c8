"""The HTTP request's span, when tracing is on (esk.tracing): ASGI middleware, outermost, so
that every request is a span, the child of the caller's `traceparent` if it sent one, and
whatever the request does (a command's record, above all) happens inside it.

A plain ASGI middleware rather than opentelemetry-instrumentation-fastapi: the command
routes are plain ASGI endpoints ahead of FastAPI (api/commands.py), and one span with the
route and the status is all the API has to say.
"""

from __future__ import annotations

from opentelemetry.trace import SpanKind, StatusCode
from starlette.types import Message, Receive, Scope, Send

from .. import tracing
from .route import RequestWatcher, route_of


class TracingMiddleware(RequestWatcher):
    async def watch(self, scope: Scope, receive: Receive, send: Send) -> None:
        method = scope["method"]
        with tracing.TRACER.start_as_current_span(
            method,  # renamed to "<method> <route>" once the route is known
            context=tracing.context_of_http(scope["headers"]),
            kind=SpanKind.SERVER,
            attributes={"http.request.method": method, "url.path": scope["path"]},
        ) as span:

            async def send_traced(message: Message) -> None:
                if message["type"] == "http.response.start":
                    status: int = message["status"]
                    span.set_attribute("http.response.status_code", status)
                    if status >= 500:
                        span.set_status(StatusCode.ERROR)
                await send(message)

            try:
                await self.app(scope, receive, send_traced)
            finally:
                route = route_of(scope)
                if route is not None:
                    span.update_name(f"{method} {route}")
                    span.set_attribute("http.route", route)
