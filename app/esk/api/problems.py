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
    500: "Internal Server Error",
    503: "Service Unavailable",
}


# The body of every problem, as /openapi.json states it (its components Problem and FieldError).
PROBLEM_SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": "RFC 9457 problem details; `code` is stable and machine-readable.",
    "required": ["type", "title", "status", "code", "detail"],
    "properties": {
        "type": {"type": "string", "pattern": "^urn:esk:problem:", "description": "urn:esk:problem:<code>"},
        "title": {"type": "string"},
        "status": {"type": "integer", "minimum": 400, "maximum": 599},
        "code": {"type": "string"},
        "detail": {"type": "string"},
        "errors": {"type": "array", "items": {"$ref": "#/components/schemas/FieldError"}},
        "current_version": {"type": "integer", "minimum": 0, "description": "The aggregate's version when it was refused"},
        "command_id": {"type": "string"},
        "positions": {
            "type": "array",
            "items": {"$ref": "#/components/schemas/Position"},
            "description": "How far the read has got (not_caught_up, history_catching_up)",
        },
    },
}
FIELD_ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": "One invalid field of a payload or request.",
    "required": ["loc", "msg", "type"],
    "properties": {
        "loc": {"type": "array", "items": {"type": ["string", "integer"]}},
        "msg": {"type": "string"},
        "type": {"type": "string"},
    },
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
