"""Which route a request took, for the middleware outside the routing that names requests
by it (a span, a metric's label): a route's template, never the path, whose ids would make
one name per aggregate."""

from __future__ import annotations

from abc import ABC, abstractmethod

from starlette.types import ASGIApp, Receive, Scope, Send

# Set in the scope by whoever routed the request: a command route (CommandRoutes) here,
# Starlette's router under "route".
ROUTE_KEY = "esk.route"


def route_of(scope: Scope) -> str | None:
    """The template of the route that took the request; None when none did (no route
    matched, or the request was refused before routing: a missing bearer token)."""
    route = scope.get(ROUTE_KEY) or getattr(scope.get("route"), "path_format", None)  # its converters left out
    return route if isinstance(route, str) else None


class RequestWatcher(ABC):
    """ASGI middleware outside the routing that watches each HTTP request (`watch`: a span, a
    metric) and names it by its route; anything else (the lifespan) passes through."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        await self.watch(scope, receive, send)

    @abstractmethod
    async def watch(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Passes the request on to `self.app`, watching it."""
