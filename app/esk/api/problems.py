"""Errors as RFC 9457 problem details (application/problem+json), each with a stable code."""

from __future__ import annotations

from typing import Any

import orjson
from starlette.responses import Response

PROBLEM_JSON = "application/problem+json"

_TITLES = {
    400: "Bad Request",
    401: "Unauthorized",
    403: "Forbidden",
    404: "Not Found",
    405: "Method Not Allowed",
    409: "Conflict",
    412: "Precondition Failed",
    413: "Content Too Large",
    415: "Unsupported Media Type",
    422: "Unprocessable Content",
    503: "Service Unavailable",
}


class Problem(Exception):
    def __init__(
        self,
        status: int,
        code: str,
        detail: str,
        headers: dict[str, str] | None = None,
        **extra: Any,
    ) -> None:
        super().__init__(detail)
        self.status = status
        self.code = code
        self.detail = detail
        self.headers = headers or {}
        self.extra = extra

    def response(self) -> Response:
        body = {
            "type": f"urn:esk:problem:{self.code}",
            "title": _TITLES.get(self.status, "Error"),
            "status": self.status,
            "code": self.code,
            "detail": self.detail,
            **self.extra,
        }
        return Response(orjson.dumps(body), status_code=self.status, headers=self.headers, media_type=PROBLEM_JSON)
