"""Which route a request took, for the middleware outside the routing that names requests
by it (a span, a metric's label): a route's template, never the path, whose ids would make
one name per aggregate."""

from __future__ import annotations

from starlette.types import Scope

# Set in the scope by whoever routed the request: a command route (CommandRoutes) here,
# Starlette's router under "route".
ROUTE_KEY = "esk.route"


def route_of(scope: Scope) -> str | None:
    """The template of the route that took the request; None when none did (no route
    matched, or the request was refused before routing: a missing bearer token)."""
    route = scope.get(ROUTE_KEY) or getattr(scope.get("route"), "path_format", None)  # its converters left out
    return route if isinstance(route, str) else None
