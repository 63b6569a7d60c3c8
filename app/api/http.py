"""The HTTP API of PRODUCT.md, v1.

One command's path: `submit_command` validates everything the client sent (type, command,
headers, size, media type, JSON, payload schema), puts a CommandEnvelope on the commands
topic through the CommandGateway, then waits on the StateReplica for the command's
outcome and turns it into a response (`outcome_response`).
"""

from __future__ import annotations

import asyncio
import logging
import re
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from app.api.auth import BearerAuth
from app.api.gateway import CommandGateway
from app.api.problems import Problem
from app.api.replica import StateReplica
from app.metrics import HTTP_OUTCOME_TIMEOUTS
from app.protocol import CommandEnvelope, Outcome, Status, StoredAggregate
from app.registry import Registry
from app.settings import Settings
from domain.aggregate import ALREADY_EXISTS, NOT_FOUND, AggregateType

log = logging.getLogger(__name__)

_VERSION_TAG = re.compile(r'^(?:W/)?"(\d{1,18})"$')
_MAX_ID = 200


def _json(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(body), status_code=status, headers=headers, media_type="application/json")


def _etag(version: int) -> dict[str, str]:
    return {"ETag": f'"{version}"'}


def _check_id(kind: str, value: str) -> None:
    if not value or len(value) > _MAX_ID or any(ord(c) < 32 for c in value):
        raise Problem(400, f"invalid_{kind}", f"{kind} must be 1 to {_MAX_ID} printable characters")


def outcome_response(outcome: Outcome) -> Response:
    """The HTTP answer to a command's outcome, the same wherever it is asked for."""
    if outcome.status is Status.ACCEPTED:
        body = {
            "command_id": outcome.command_id,
            "type": outcome.aggregate_type,
            "id": outcome.aggregate_id,
            "version": outcome.version,
            "events": outcome.events,
        }
        return _json(body, 200, _etag(outcome.version))
    extra = {"command_id": outcome.command_id, "current_version": outcome.version}
    headers = _etag(outcome.version) if outcome.version > 0 else {}
    if outcome.status is Status.PRECONDITION_FAILED:
        return Problem(412, outcome.code or "precondition_failed", outcome.detail or "", headers, **extra).response()
    status = {NOT_FOUND: 404, ALREADY_EXISTS: 409}.get(outcome.code or "", 422)
    return Problem(status, outcome.code or "rejected", outcome.detail or "", headers, **extra).response()


def create_app(settings: Settings, registry: Registry) -> FastAPI:
    gateway = CommandGateway(settings)
    replica = StateReplica(settings)
    pending: set[str] = set()  # commands this instance submitted and is still waiting for

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        await replica.start()
        await gateway.start()
        try:
            yield
        finally:
            await gateway.stop()
            await replica.stop()

    app = FastAPI(
        title=f"esk: {settings.app}",
        version="1",
        lifespan=lifespan,
        description="Commands in, events out. Every error is application/problem+json.",
    )
    app.state.replica = replica
    app.state.gateway = gateway

    @app.exception_handler(Problem)
    async def _problem(_request: Request, problem: Problem) -> Response:
        return problem.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_request: Request, error: StarletteHTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(error.status_code, "http_error")
        return Problem(error.status_code, code, str(error.detail), dict(error.headers or {})).response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, error: RequestValidationError) -> Response:
        errors = [{"loc": list(e["loc"]), "msg": e["msg"], "type": e["type"]} for e in error.errors()]
        return Problem(422, "invalid_request", "the request is invalid", errors=errors).response()

    if settings.api.auth_tokens:
        app.add_middleware(BearerAuth, tokens=frozenset(settings.api.auth_tokens))

    # -- commands ------------------------------------------------------------------

    async def submit_command(request: Request, aggregate_type: AggregateType[Any], aggregate_id: str, name: str) -> Response:
        _check_id("aggregate_id", aggregate_id)
        payload = await _read_json(request, settings.api.max_body_bytes)
        try:
            aggregate_type.parse_command(name, payload)
        except ValidationError as error:
            errors = [{"loc": list(e["loc"]), "msg": e["msg"], "type": e["type"]} for e in error.errors()]
            raise Problem(422, "invalid_payload", f"the {name} payload is invalid", errors=errors) from None
        expected_version, expect_new = _preconditions(request)
        command_id = request.headers.get("idempotency-key") or uuid.uuid4().hex
        _check_id("idempotency_key", command_id)
        location = f"/v1/commands/{command_id}"

        # A retry whose outcome is known already is answered without touching Kafka.
        known = replica.outcome(command_id)
        if known is not None:
            return outcome_response(known)
        envelope = CommandEnvelope(
            command_id=command_id,
            aggregate_type=aggregate_type.name,
            aggregate_id=aggregate_id,
            command=name,
            payload=payload,
            expected_version=expected_version,
            expect_new=expect_new,
            correlation_id=request.headers.get("x-correlation-id") or command_id,
            causation_id=request.headers.get("x-causation-id"),
        )
        try:
            await gateway.submit(envelope)
        except Exception as error:  # not acknowledged: the client must retry (same Idempotency-Key)
            log.warning("could not submit command %s: %r", command_id, error)
            raise Problem(
                503, "kafka_unavailable", "the command could not be stored; retry with the same Idempotency-Key",
                {"Retry-After": str(settings.api.retry_after_s)},
            ) from None
        if "respond-async" in request.headers.get("prefer", ""):
            return _json(
                {"command_id": command_id, "status": "pending"},
                202,
                {"Location": location, "Preference-Applied": "respond-async"},
            )
        pending.add(command_id)
        try:
            outcome = await replica.wait_outcome(command_id, settings.api.outcome_timeout_s)
        finally:
            pending.discard(command_id)
        if outcome is None:
            HTTP_OUTCOME_TIMEOUTS.inc()
            raise Problem(
                503, "outcome_pending", "the command is accepted and will be processed; its outcome is not in yet",
                {"Retry-After": str(settings.api.retry_after_s), "Location": location},
                command_id=command_id,
            )
        return outcome_response(outcome)

    def _command_route(aggregate_type: AggregateType[Any], name: str) -> Callable[..., Awaitable[Response]]:
        async def route(request: Request, id: str) -> Response:  # noqa: A002 - the path says {id}
            return await submit_command(request, aggregate_type, id, name)

        return route

    @app.get("/v1/commands/{command_id}", tags=["commands"], summary="The outcome of a command")
    async def get_command(command_id: str) -> Response:
        outcome = replica.outcome(command_id)
        if outcome is not None:
            body = {**orjson.loads(outcome.encode()), "http_status": outcome_response(outcome).status_code}
            return _json(body)
        if command_id in pending:
            return _json({"command_id": command_id, "status": "pending"}, 202)
        raise Problem(404, "unknown_command_id", "no outcome for this command (unknown, expired, or not processed yet)")

    @app.get("/v1/projections/{name}", tags=["read models"], summary="Rows of a read model, filtered by ?column=value")
    async def get_projection(name: str, request: Request, limit: int | None = None) -> Response:
        filters = {k: v for k, v in request.query_params.items() if k != "limit"}
        row_limit = min(limit or settings.projections.api_row_limit, settings.projections.api_row_limit)
        rows = await _read_model(name, filters, row_limit)
        return _json({"name": name, "rows": rows, "count": len(rows)})

    @app.get("/v1/{type_name}/{id}/events", tags=["state"], summary="An aggregate's history (from the events archive)")
    async def get_history(type_name: str, id: str) -> Response:  # noqa: A002
        if type_name not in registry:
            raise Problem(404, "unknown_aggregate_type", f"no aggregate type {type_name!r}")
        rows = await _read_model("events_archive", {"aggregate_type": type_name, "aggregate_id": id}, 100_000)
        if not rows:
            raise Problem(404, "not_found", f"no archived events for {type_name} {id!r} (the archive is a projection: run it)")
        events = [
            {k: r[k] for k in ("event_id", "type", "version", "schema_version", "recorded_at", "command_id")}
            | {"data": orjson.loads(r["data"])}
            for r in rows
        ]
        return _json({"type": type_name, "id": id, "events": events})

    async def _read_model(name: str, filters: dict[str, str], limit: int) -> list[dict[str, Any]]:
        try:
            from projections.catalog import Tables
            from projections.reader import BadFilter, ReadModelNotBuilt, ReadModelNotFound, read_rows
        except ImportError:
            raise Problem(503, "projections_unavailable", "install esk with the spark extra to serve read models") from None
        try:
            tables = Tables(settings.projections.warehouse_dir)
            return await asyncio.to_thread(read_rows, tables, name, filters, limit)
        except ReadModelNotFound:
            raise Problem(404, "unknown_projection", f"no read model {name!r}") from None
        except ReadModelNotBuilt:
            raise Problem(
                503, "projection_not_built", f"{name} has not been built yet: run `esk project run {name}`",
                {"Retry-After": "60"},
            ) from None
        except BadFilter as error:
            raise Problem(400, "invalid_filter", str(error)) from None

    for aggregate_type in registry.values():
        for name, model in aggregate_type.commands.items():
            app.add_api_route(
                f"/v1/{aggregate_type.name}/{{id}}/{name}",
                _command_route(aggregate_type, name),
                methods=["POST"],
                tags=[aggregate_type.name],
                summary=f"{name} ({model.__name__})",
                description=(model.__doc__ or "")
                + "\n\nHeaders: If-Match: \"<version>\", If-None-Match: *, Idempotency-Key, Prefer: respond-async.",
                openapi_extra={
                    "requestBody": {
                        "required": False,
                        "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{_schema_name(aggregate_type, model)}"}}},
                    }
                },
            )

    @app.post("/v1/{type_name}/{id}/{command}", include_in_schema=False)
    async def unknown_command(type_name: str, id: str, command: str) -> Response:  # noqa: A002
        if type_name not in registry:
            raise Problem(404, "unknown_aggregate_type", f"no aggregate type {type_name!r}")
        raise Problem(404, "unknown_command", f"{type_name} has no command {command!r}")

    # -- state -----------------------------------------------------------------------

    @app.get("/v1/{type_name}/{id}", tags=["state"], summary="Current state and version of an aggregate")
    async def get_aggregate(type_name: str, id: str, min_version: int | None = None) -> Response:  # noqa: A002
        if type_name not in registry:
            raise Problem(404, "unknown_aggregate_type", f"no aggregate type {type_name!r}")
        _check_id("aggregate_id", id)
        stored: StoredAggregate | None
        if min_version is not None:
            if min_version < 0:
                raise Problem(400, "invalid_min_version", "min_version must be >= 0")
            stored = await replica.wait_version(type_name, id, min_version, settings.api.min_version_timeout_s)
            if stored is None or stored.version < min_version:
                raise Problem(
                    503, "version_not_visible", f"version {min_version} is not visible here yet",
                    {"Retry-After": str(settings.api.retry_after_s)},
                    current_version=stored.version if stored else 0,
                )
        else:
            stored = replica.aggregate(type_name, id)
        if stored is None:
            raise Problem(404, "not_found", f"{type_name} {id!r} does not exist")
        body = {"type": type_name, "id": id, "version": stored.version, "state": stored.state}
        return _json(body, 200, _etag(stored.version))

    # -- operations ------------------------------------------------------------------

    @app.get("/healthz", tags=["operations"])
    async def healthz() -> Response:
        return _json({"status": "ok"})

    @app.get("/readyz", tags=["operations"])
    async def readyz() -> Response:
        if replica.ready.is_set():
            return _json({"status": "ready"})
        return Problem(503, "not_ready", "restoring state from the changelog", {"Retry-After": "1"}).response()

    @app.get("/metrics", tags=["operations"])
    async def metrics() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    _document_schemas(app, registry)
    return app


async def _read_json(request: Request, limit: int) -> dict[str, Any]:
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise Problem(413, "body_too_large", f"the body may have at most {limit} bytes")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise Problem(413, "body_too_large", f"the body may have at most {limit} bytes")
    if not body.strip():
        return {}
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type != "application/json" and not (media_type.startswith("application/") and media_type.endswith("+json")):
        raise Problem(415, "unsupported_media_type", "send the command as application/json")
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError as error:
        raise Problem(400, "malformed_json", f"the body is not valid JSON: {error}") from None
    if not isinstance(payload, dict):
        raise Problem(422, "invalid_payload", "the body must be a JSON object")
    return payload


def _preconditions(request: Request) -> tuple[int | None, bool]:
    if_match = request.headers.get("if-match")
    if_none_match = request.headers.get("if-none-match")
    expected: int | None = None
    if if_match is not None:
        match = _VERSION_TAG.match(if_match.strip())
        if match is None:
            raise Problem(400, "invalid_if_match", 'If-Match must be a version tag such as "3"')
        expected = int(match.group(1))
    if if_none_match is not None and if_none_match.strip() != "*":
        raise Problem(400, "invalid_if_none_match", "only If-None-Match: * is supported (the aggregate must not exist)")
    return expected, if_none_match is not None


def _schema_name(aggregate_type: AggregateType[Any], model: type) -> str:
    return f"{aggregate_type.name}.{model.__name__}"


def _document_schemas(app: FastAPI, registry: Registry) -> None:
    """Put every command, event and state schema into /openapi.json."""
    base_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = base_openapi()
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for aggregate_type in registry.values():
            models: list[tuple[str, type]] = [(_schema_name(aggregate_type, m), m) for m in aggregate_type.commands.values()]
            models += [(f"{aggregate_type.name}.events.{e.type_name()}", e) for e in aggregate_type.events]
            models.append((f"{aggregate_type.name}.State", aggregate_type.state))
            for name, model in models:
                model_schema = model.model_json_schema(ref_template=f"#/components/schemas/{name}.{{model}}")  # type: ignore[attr-defined]
                for def_name, definition in model_schema.pop("$defs", {}).items():
                    components[f"{name}.{def_name}"] = definition
                if name.startswith(f"{aggregate_type.name}.events."):
                    model_schema["x-schema-version"] = model.schema_version  # type: ignore[attr-defined]
                components[name] = model_schema
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
