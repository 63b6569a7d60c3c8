"""Bearer tokens for the /v1/ API (ESK_API__AUTH_TOKENS); operations endpoints stay open."""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from .problems import Problem


class BearerAuth:
    """A plain ASGI middleware. `@app.middleware("http")` would build Starlette's
    BaseHTTPMiddleware, which runs every request through an extra task and memory streams:
    measured under load, that was the largest single cost of a command in the API process."""

    def __init__(self, app: ASGIApp, tokens: frozenset[str]) -> None:
        self.app = app
        self.tokens = tokens

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            refusal = self.refusal(Headers(scope=scope).get("authorization", ""))
            if refusal is not None:
                await refusal.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def refusal(self, authorization: str) -> Problem | None:
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token:
            return Problem(401, "unauthorized", "a bearer token is required", {"WWW-Authenticate": "Bearer"})
        if token not in self.tokens:
            return Problem(403, "forbidden", "this token may not call the API")
        return None
