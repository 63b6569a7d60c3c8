"""The HTTP API v1 (docs/product.md): FastAPI for reads, operations and /openapi.json.

Commands come in through api/commands.py (one ASGI endpoint per command, reached
through the CommandRoutes middleware); this module routes to them and documents them
beside the FastAPI routes.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from ..domain.aggregate import AggregateType, Event
from ..projections.reader import BadFilter, ReadModelNotBuilt, ReadModelNotFound, ReadModelRows
from ..protocol import StoredAggregate
from ..registry import Registry
from ..settings import Settings
from .auth import BearerAuth
from .commands import (
    MAX_ID,
    CommandEndpoint,
    CommandIntake,
    CommandRoutes,
    check_id,
    command_url,
    etag,
    json_response,
    outcome_response,
)
from .gateway import CommandGateway
from .problems import Problem
from .replica import StateReplica


def create_app(settings: Settings, registry: Registry) -> FastAPI:
    gateway = CommandGateway(settings)
    read_models = ReadModelRows(settings)
    replica = StateReplica(settings)
    intake = CommandIntake(settings, gateway, replica)

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

    # The last added is the outermost: auth comes before the commands' routes.
    endpoints = [CommandEndpoint(intake, t, name) for t in registry.values() for name in t.commands]
    app.add_middleware(CommandRoutes, endpoints=endpoints)
    if settings.api.auth_tokens:
        app.add_middleware(BearerAuth, tokens=frozenset(settings.api.auth_tokens))

    # -- commands ------------------------------------------------------------------

    @app.get("/v1/commands/{command_id}", tags=["commands"], summary="The outcome of a command")
    async def get_command(command_id: str) -> Response:
        outcome = replica.outcome(command_id)
        if outcome is not None:
            body = {**orjson.loads(outcome.encode()), "http_status": outcome_response(outcome).status_code}
            return json_response(body)
        if command_id in intake.pending:
            return json_response({"command_id": command_id, "status": "pending"}, 202)
        raise Problem(404, "unknown_command_id", "no outcome for this command (unknown, expired, or not processed yet)")

    @app.get("/v1/projections/{name}", tags=["read models"], summary="Rows of a read model, filtered by ?column=value")
    async def get_projection(name: str, request: Request, limit: int | None = None) -> Response:
        filters = {k: v for k, v in request.query_params.items() if k != "limit"}
        row_limit = min(limit or settings.projections.api_row_limit, settings.projections.api_row_limit)
        rows = await _read_model(name, filters, row_limit)
        return json_response({"name": name, "rows": rows, "count": len(rows)})

    @app.get("/v1/{type_name}/{id}/events", tags=["state"], summary="An aggregate's history (from the events archive)")
    async def get_history(type_name: str, id: str) -> Response:
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
        return json_response({"type": type_name, "id": id, "events": events})

    async def _read_model(name: str, filters: dict[str, str], limit: int) -> list[dict[str, Any]]:
        try:
            return await asyncio.to_thread(read_models.read, name, filters, limit)
        except ImportError:  # delta-rs, or the user's read models' own imports
            raise Problem(503, "projections_unavailable", "install esk with the spark extra to serve read models") from None
        except ReadModelNotFound:
            raise Problem(404, "unknown_projection", f"no read model {name!r}") from None
        except ReadModelNotBuilt:
            raise Problem(
                503, "projection_not_built", f"{name} has not been built yet: run `esk project run {name}`",
                {"Retry-After": "60"},
            ) from None
        except BadFilter as error:
            raise Problem(400, "invalid_filter", str(error)) from None
        except (LookupError, TypeError, ValueError) as error:  # ESK_READ_MODELS names something unusable
            raise Problem(503, "read_models_misconfigured", str(error)) from None

    @app.post("/v1/{type_name}/{id}/{command}", include_in_schema=False)
    async def unknown_command(type_name: str, id: str, command: str) -> Response:
        if type_name not in registry:
            raise Problem(404, "unknown_aggregate_type", f"no aggregate type {type_name!r}")
        raise Problem(404, "unknown_command", f"{type_name} has no command {command!r}")

    # -- state -----------------------------------------------------------------------

    @app.get("/v1/{type_name}/{id}", tags=["state"], summary="Current state and version of an aggregate")
    async def get_aggregate(type_name: str, id: str, min_version: int | None = None) -> Response:
        if type_name not in registry:
            raise Problem(404, "unknown_aggregate_type", f"no aggregate type {type_name!r}")
        check_id("aggregate_id", id)
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
        return json_response(body, 200, etag(stored.version))

    # -- operations ------------------------------------------------------------------

    @app.get("/healthz", tags=["operations"])
    async def healthz() -> Response:
        return json_response({"status": "ok"})

    @app.get("/readyz", tags=["operations"])
    async def readyz() -> Response:
        if replica.ready.is_set():
            return json_response({"status": "ready"})
        return Problem(503, "not_ready", "restoring state from the changelog", {"Retry-After": "1"}).response()

    @app.get("/metrics", tags=["operations"])
    async def metrics() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    _document_schemas(app, registry)
    return app


def _schema_name(aggregate_type: AggregateType[Any], model: type) -> str:
    return f"{aggregate_type.name}.{model.__name__}"


_COMMAND_HEADERS = (
    ("If-Match", 'Optimistic concurrency: the version the command expects, e.g. "3".'),
    ("If-None-Match", "`*`: the aggregate must not exist yet."),
    ("Idempotency-Key", "The command id: a retry with the same key gets the first outcome."),
    ("Prefer", "`respond-async`: answer 202 once the command is stored, without waiting."),
    ("X-Correlation-Id", "Copied onto the events (defaults to the command id)."),
    ("X-Causation-Id", "What caused the command (e.g. an event's id), kept with it; its events' causation is the command."),
)
_COMMAND_ANSWERS = {
    "200": "Accepted: the new version and the events",
    "202": "Stored; the outcome is at the Location (Prefer: respond-async)",
    "404": "The aggregate does not exist",
    "409": "The aggregate exists already",
    "412": "The version is not the one in If-Match",
    "422": "Refused by the domain, or an invalid payload",
    "503": "Not stored (retry with the same Idempotency-Key), or no outcome in time",
}


def _command_path(aggregate_type: AggregateType[Any], name: str, model: type) -> dict[str, Any]:
    """The OpenAPI path item of a command endpoint (they are not FastAPI routes)."""
    problem = {"application/problem+json": {"schema": {"type": "object"}}}
    parameters = [{"name": "id", "in": "path", "required": True, "schema": {"type": "string", "maxLength": MAX_ID}}]
    parameters += [{"name": h, "in": "header", "required": False, "description": d, "schema": {"type": "string"}}
                   for h, d in _COMMAND_HEADERS]
    return {
        "post": {
            "tags": [aggregate_type.name],
            "summary": f"{name} ({model.__name__})",
            "description": model.__doc__ or "",
            "operationId": f"{aggregate_type.name}_{name}",
            "parameters": parameters,
            "requestBody": {
                "required": False,
                "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{_schema_name(aggregate_type, model)}"}}},
            },
            "responses": {
                code: {"description": text, "content": {"application/json": {"schema": {"type": "object"}}} if int(code) < 400 else problem}
                for code, text in _COMMAND_ANSWERS.items()
            },
        }
    }


def _document_schemas(app: FastAPI, registry: Registry) -> None:
    """Put every command endpoint, and every command, event and state schema, into /openapi.json."""
    base_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = base_openapi()
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        paths = schema.setdefault("paths", {})
        for aggregate_type in registry.values():
            for command, model in aggregate_type.commands.items():
                paths[command_url(aggregate_type, command)] = _command_path(aggregate_type, command, model)
            models: list[tuple[str, type[BaseModel]]] = [(_schema_name(aggregate_type, m), m) for m in aggregate_type.commands.values()]
            models += [(f"{aggregate_type.name}.events.{e.type_name()}", e) for e in aggregate_type.events]
            models.append((f"{aggregate_type.name}.State", aggregate_type.state))
            for name, documented in models:
                model_schema = documented.model_json_schema(ref_template=f"#/components/schemas/{name}.{{model}}")
                for def_name, definition in model_schema.pop("$defs", {}).items():
                    components[f"{name}.{def_name}"] = definition
                if issubclass(documented, Event):
                    model_schema["x-schema-version"] = documented.schema_version
                components[name] = model_schema
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI documents this way of extending the schema
