"""The HTTP API v1 (docs/product.md): FastAPI for reads, operations and /openapi.json.

Commands come in through api/commands.py (one ASGI endpoint per command, reached
through the CommandRoutes middleware); this module routes to them. api/openapi.py
documents every operation, so the routes here are left out of FastAPI's own document.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import orjson
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.convertors import PathConvertor, register_url_convertor
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..kafka.acls import AUTHORIZATION_REFUSED
from ..kafka.topics import TopicNames
from ..metrics import READ_MODEL_LAG, READ_MODEL_PARKED, READ_MODEL_POSITION, Kind, exported
from ..projections.catalog import needs_spark_extra
from ..projections.positions import Positions
from ..projections.positions import as_json as positions_json
from ..projections.reader import BadFilter, ReadModelNotBuilt, ReadModelNotFound, ReadModelRows
from ..protocol import MAX_VERSION, StoredAggregate
from ..registry import ImportFailed, Registry
from ..schema.asyncapi import asyncapi_document
from ..schema.lock import LockError, project_lock
from ..settings import Settings
from .auth import BearerAuth
from .commands import AGGREGATE_ID, CommandEndpoint, CommandIntake, CommandRoutes, etag, json_response, outcome_status
from .gateway import CommandGateway
from .history import EventHistory, events_as_current
from .openapi import READ_PARAMETERS, document
from .positions import EventPositions
from .problems import Problem
from .read_after import ReadAfter
from .replica import StateReplica
from .request_metrics import RequestMetrics
from .tracing import TracingMiddleware

log = logging.getLogger(__name__)
T = TypeVar("T")


class _AnyText(PathConvertor):
    """Starlette's `path`, line breaks and all: its `.*` stops at a newline, and a command
    id with one (decoded from %0A) would then fall through to GET /v1/{type}/{id}, whose 404
    is another problem than the outcome's."""

    regex = "[\\s\\S]*"


register_url_convertor("any_text", _AnyText())
# Told with a read model's 503: nothing keeps it up, so waiting will not help.
NO_RUN = "no run keeps it up now (`esk project list` says who keeps each read model; a driver's log, why it stopped)"


# The problem of a query parameter given twice (but `after`, a list): which was meant
# cannot be told, where a framework would take the last.
_GIVEN_TWICE = {"limit": "invalid_limit", "wait_ms": "invalid_wait", "from_version": "invalid_from_version"}


def _given_once(request: Request, others: str | None = None) -> None:
    """Each parameter given once; `others`: the problem of any other (a read model's filter)."""
    given = Counter(k for k, _ in request.query_params.multi_items() if k != "after")
    for name in sorted(k for k, n in given.items() if n > 1):
        code = _GIVEN_TWICE.get(name, others)
        if code is not None:
            raise Problem(400, code, f"{name}: given more than once; it takes one value")


class HeadAsGet:
    """HEAD is served as its GET, without the body (FastAPI's routes take GET alone): a
    client asks for an aggregate's ETag, or whether a resource is there, without its body."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            await self.app(scope, receive, send)
            return

        async def headers_only(message: Message) -> None:
            if message["type"] == "http.response.body":
                if message.get("more_body", False):
                    return
                message = {"type": "http.response.body", "body": b"", "more_body": False}
            await send(message)

        # A copy: the server reads the method of its own scope as the answer goes out (a
        # HEAD's has no body; a GET's one of its Content-Length). What the routes write into
        # it (its route, for a span's name) is put back for the middleware outside.
        as_get = {**scope, "method": "GET"}
        try:
            await self.app(as_get, receive, headers_only)
        finally:
            scope.update((key, value) for key, value in as_get.items() if key != "method")


def _fastapi_telemetry(settings: Settings) -> dict[str, Any]:
    """FastAPI's own tracing off while esk's is on. FastAPI (recent versions) traces every
    request by itself as soon as the process has a TracerProvider, but its span is named
    only after the routes its router sees, which the command routes bypass; esk's
    TracingMiddleware names both kinds. One server span per request, not two."""
    if settings.tracing.enabled and "telemetry" in inspect.signature(FastAPI.__init__).parameters:
        return {"telemetry": {"tracing": False}}
    return {}


def server_options(settings: Settings) -> dict[str, Any]:
    """How uvicorn serves the API (`uvicorn.Config`'s arguments)."""
    return {
        "host": settings.api.host,
        "port": settings.api.port,
        "log_level": settings.log_level.lower(),
        "log_config": None,  # its lines through esk's handler (esk.logs): one format, text or JSON
        "access_log": False,
        "timeout_keep_alive": settings.api.keep_alive_s,
        "timeout_graceful_shutdown": 10,
    }


def create_app(settings: Settings, registry: Registry) -> FastAPI:
    gateway = CommandGateway(settings)
    names = TopicNames(settings.app)
    read_models = ReadModelRows(settings)
    replica = StateReplica(settings)
    history = EventHistory(settings, registry) if settings.api.history else None
    positions = EventPositions(settings)
    intake = CommandIntake(settings, gateway, replica, positions)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await _tell_read_models_misconfigured()
        try:
            await replica.start()
            if history is not None:
                # Once the replica has caught up: a long history must not delay serving commands.
                await history.start(not_before=replica.ready)
            await gateway.start()
            await positions.start()
        except AUTHORIZATION_REFUSED as error:
            # An ACL missing (the producer's Write, say): the start fails, and `run_api`
            # tells it in a line rather than uvicorn's traceback.
            app.state.refused = error
            raise
        try:
            yield
        finally:
            await positions.stop()
            await gateway.stop()
            if history is not None:
                await history.stop()
            await replica.stop()

    app = FastAPI(
        title=f"esk: {settings.app}",
        version="1",
        lifespan=lifespan,
        description="Commands in, events out. Every error is application/problem+json.",
        **_fastapi_telemetry(settings),
    )
    app.state.replica = replica
    app.state.refused = None
    app.state.history = history
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

    @app.exception_handler(Exception)
    async def _failed(_request: Request, _error: Exception) -> Response:
        # A defect, esk's or the domain's: the client is still told in a problem, and
        # Starlette raises the error on, for the server to log with its traceback.
        return Problem(500, "internal_error", "the server failed to answer this request; its log says why").response()

    # The last added is the outermost: auth comes before the commands' routes.
    endpoints = [CommandEndpoint(intake, t, name) for t in registry.values() for name in t.commands]
    app.add_middleware(CommandRoutes, endpoints=endpoints)
    if settings.api.auth_tokens:
        app.add_middleware(BearerAuth, tokens=frozenset(settings.api.auth_tokens))
    app.add_middleware(HeadAsGet)
    app.add_middleware(RequestMetrics)
    if settings.tracing.enabled:  # outermost: a refused request is a span too
        app.add_middleware(TracingMiddleware)

    router = APIRouter(include_in_schema=False)

    # -- commands ------------------------------------------------------------------

    # A command id may hold "/" (escaped as %2F, which the path arrives decoded from).
    @router.get("/v1/commands/{command_id:any_text}")
    async def get_command(command_id: str, request: Request, wait_ms: int | None = None) -> Response:
        _given_once(request)
        if wait_ms is not None and wait_ms < 0:
            raise Problem(400, "invalid_wait", "wait_ms must be >= 0")
        outcome = replica.outcome(command_id)
        if outcome is None and wait_ms:  # submitted through another instance, say: its outcome on its way here
            outcome = await replica.wait_outcome(command_id, lambda _: True, min(wait_ms / 1000, settings.api.read_wait_max_s))
        if outcome is not None:
            intake.submitted.discard(command_id)
            aggregate = registry.get(outcome.aggregate_type)
            events = events_as_current(aggregate, outcome.events, f"the outcome of command {command_id!r}")
            body = {**orjson.loads(outcome.encode()), "events": events, "http_status": outcome_status(outcome)}
            return json_response(body)
        if command_id in intake.submitted:
            return json_response({"command_id": command_id, "status": "pending"}, 202)
        raise Problem(
            404, "unknown_command_id",
            "no outcome for this command here (unknown, expired, or not processed yet; one submitted through another API "
            "instance reads so until its outcome is in: wait_ms waits for it)",
        )  # fmt: skip

    @router.get("/v1/projections/{name}")
    async def get_projection(name: str, request: Request, limit: int | None = None, wait_ms: int | None = None) -> Response:
        if limit is not None and limit < 1:
            raise Problem(400, "invalid_limit", "limit must be >= 1")
        after = ReadAfter.of(request.query_params.getlist("after"), wait_ms, settings.api.read_wait_max_s)
        filters = {k: v for k, v in request.query_params.items() if k not in READ_PARAMETERS}
        _given_once(request, others="invalid_filter")
        row_limit = min(limit or settings.projections.api_row_limit, settings.projections.api_row_limit)
        read = await _guarded(name, lambda: read_models.model(name))
        after.check_topics(name, {names.events(category) for category in read.categories})
        after.check_partitions(settings.topics.partitions)

        not_built: list[Problem] = []  # as last seen

        async def read_model_positions() -> Positions:
            not_built.clear()
            try:
                return await _guarded(name, lambda: read_models.positions(name))
            except Problem as problem:
                # A table not built yet reflects nothing: a read that waits (for positions,
                # or `wait_ms` alone) waits for the first build as well (what `esk dev` or a
                # new deployment is running), and says it was not built if it still was not.
                if after.wait_s <= 0 or problem.code != "projection_not_built":
                    raise
                not_built.append(problem)
                return {}

        try:
            positions = await after.reflected(name, read_model_positions, settled=lambda: not not_built)
        except Problem as problem:
            raise await _who_keeps(name, not_built[0] if not_built else problem) from None
        view = await _guarded(name, lambda: read_models.view(name, filters, row_limit + 1))  # one more: whether the limit cut any
        more, rows = len(view.rows) > row_limit, view.rows[:row_limit]
        # The positions reflected pass a parked aggregate's events: a read-your-writes caller
        # tells from these whether its own aggregate's rows stopped short.
        parked = [{"aggregate_type": p.aggregate_type, "aggregate_id": p.aggregate_id} for p in view.parked]
        return json_response(
            {"name": name, "rows": rows, "count": len(rows), "more": more, "positions": positions_json(positions), "parked": parked}
        )

    @router.get("/v1/{type_name}/{id}/events")
    async def get_history(
        type_name: str, id: str, request: Request, wait_ms: int | None = None, from_version: int = 1, limit: int | None = None
    ) -> Response:
        if type_name not in registry:
            raise Problem(404, "unknown_aggregate_type", f"no aggregate type {type_name!r}")
        AGGREGATE_ID.check(id)
        page_max = settings.api.history_page_max
        if not 1 <= from_version <= MAX_VERSION:
            raise Problem(400, "invalid_from_version", f"from_version must be between 1 and {MAX_VERSION}")
        if limit is not None and not 1 <= limit <= page_max:
            raise Problem(400, "invalid_limit", f"limit must be between 1 and {page_max}")
        if history is None:
            raise Problem(404, "history_disabled", "this API instance keeps no history index (ESK_API__HISTORY=false)")
        _given_once(request)
        after = ReadAfter.of(request.query_params.getlist("after"), wait_ms, settings.api.read_wait_max_s)
        after.check_topics("the history index", history.topics)
        after.check_partitions(settings.topics.partitions)
        after = await after.until(history.ready)  # a read that may wait waits for the index's catch-up too
        if not history.ready.is_set():
            raise Problem(
                503, "history_catching_up", "the history index is still reading the events topics since the API started",
                {"Retry-After": str(settings.api.retry_after_s)}, positions=positions_json(history.positions()),
            )
        positions = await after.reflected("the history index", history.current_positions, history.moved)
        page = await history.read(type_name, id, from_version, limit or page_max)
        # A page past the last event is empty, of an aggregate that still has events.
        if not page.events and (from_version == 1 or not (await history.read(type_name, id, 1, 1)).events):
            raise Problem(404, "not_found", f"{type_name} {id!r} has no events")
        return json_response({
            "type": type_name, "id": id, "events": page.events, "next_version": page.next_version,
            "positions": positions_json(positions),
        })

    async def _who_keeps(name: str, problem: Problem) -> Problem:
        """A read model's 503 as it is answered, saying whether a run keeps the read model up:
        waiting longer helps only if one does. Asked once an answer is due, not at each look
        while a read waits: each asks the lock of the warehouse (a round trip on NFS)."""
        if problem.code not in ("projection_not_built", "not_caught_up"):
            return problem
        keepers = await asyncio.to_thread(read_models.keepers, name)
        if keepers is None:
            return problem
        if (why := keepers.held_up_reader()) is not None:
            problem.detail += f"; the run keeping it is held up: {why}"
            problem.headers.pop("Retry-After", None)  # until someone acts
        elif problem.code == "projection_not_built" and keepers.runs:
            problem.detail = f"{name} has not been built yet: a run is building it"
        elif (current := keepers.standing_still()) is not None:
            problem.detail += (
                f"; generation {current + 1} is being built beside it (a changed read model, or a rebuild), "
                f"and readers stay on {current}, which stands still, until it has caught up"
            )
        elif not keepers.runs and keepers.left_out is not None:
            problem.detail += f"; the driver running the read models left it out ({keepers.left_out.who}): {keepers.left_out.held_up}"
            problem.headers.pop("Retry-After", None)  # until its code is fixed
        elif not keepers.runs:
            problem.detail += f"; {NO_RUN}"
            problem.headers.pop("Retry-After", None)  # a retry would get the same answer
        return problem

    async def _tell_read_models_misconfigured() -> None:
        """At the start, in the log, what every read of a read model would answer: a setting
        that names nothing usable is otherwise seen by the first reader only."""
        try:
            await _guarded("", read_models.names)
        except Problem as problem:
            if problem.code == "read_models_misconfigured":
                log.warning("%s: reads of read models answer 503 read_models_misconfigured", problem.detail)

    async def _guarded(name: str, read: Callable[[], T]) -> T:
        """`read` of the read models, with what can go wrong as the problems of the API."""
        try:
            return await asyncio.to_thread(read)
        except ImportError as error:  # delta-rs, or the user's read models' own imports
            if needs_spark_extra(error):
                raise Problem(503, "projections_unavailable", "install esk with the spark extra to serve read models") from None
            raise Problem(503, "read_models_misconfigured", f"ESK_READ_MODELS={settings.read_models}: {error}") from None
        except ImportFailed as error:  # the user's read models' module raised as it was imported
            raise Problem(503, "read_models_misconfigured", str(error)) from None
        except ReadModelNotFound:
            known = ", ".join(read_models.names()) or "none"
            raise Problem(
                404, "unknown_projection",
                f"no read model {name!r}; this API knows {known} (it loads ESK_READ_MODELS once: one added since needs it restarted)",
            ) from None
        except ReadModelNotBuilt:
            raise Problem(
                503, "projection_not_built", f"{name} has not been built yet: run `esk project run {name}`", {"Retry-After": "60"}
            ) from None
        except BadFilter as error:
            raise Problem(400, "invalid_filter", str(error)) from None
        except (LookupError, TypeError, ValueError) as error:  # ESK_READ_MODELS names something unusable
            raise Problem(503, "read_models_misconfigured", str(error)) from None

    @router.post("/v1/{type_name}/{id}/{command}")
    async def unknown_command(type_name: str, id: str, command: str) -> Response:
        if type_name not in registry:
            raise Problem(404, "unknown_aggregate_type", f"no aggregate type {type_name!r}")
        known = ", ".join(sorted(registry[type_name].commands))
        raise Problem(404, "unknown_command", f"{type_name} has no command {command!r}; its commands: {known}")

    # -- state -----------------------------------------------------------------------

    @router.get("/v1/{type_name}/{id}")
    async def get_aggregate(type_name: str, id: str, min_version: int | None = None) -> Response:
        if type_name not in registry:
            raise Problem(404, "unknown_aggregate_type", f"no aggregate type {type_name!r}")
        AGGREGATE_ID.check(id)
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
        body = {"type": type_name, "id": id, "version": stored.version, "state": stored.state, "unusable": stored.unusable}
        return json_response(body, 200, etag(stored.version))

    # -- operations ------------------------------------------------------------------

    @router.get("/healthz")
    async def healthz() -> Response:
        return json_response({"status": "ok"})

    @router.get("/readyz")
    async def readyz() -> Response:
        if replica.ready.is_set():
            return json_response({"status": "ready"})
        return Problem(503, "not_ready", "restoring state from the changelog", {"Retry-After": "1"}).response()

    metrics_of = exported(Kind.API)

    @router.get("/metrics")
    async def metrics() -> Response:
        await asyncio.to_thread(_read_model_positions)
        return Response(generate_latest(metrics_of), media_type=CONTENT_TYPE_LATEST)

    def _read_model_positions() -> None:
        """How far each read model has read, as of this scrape (from its checkpoint's files),
        and how far behind the events topics it is, by the history index's positions: what
        an alert on a read model that stopped keeping up needs."""
        try:
            read_model_names = read_models.names()
        except Exception as error:  # read models not servable here: /v1/projections says why
            log.debug("read model positions left out of /metrics: %r", error)
            return
        heads = history.positions() if history is not None and history.ready.is_set() else None
        for name in read_model_names:
            try:
                READ_MODEL_PARKED.labels(name).set(len(read_models.parked(name)))
            except Exception as error:  # its positions and lag still count
                log.debug("read model %s's parked aggregates left out of /metrics: %r", name, error)
            try:
                positions = read_models.positions(name)
            except ReadModelNotBuilt:
                positions = {}  # behind by every event there is
            except Exception as error:  # a checkpoint file being written, say: the others' still count
                log.debug("read model %s left out of /metrics: %r", name, error)
                continue
            for (topic, partition), offset in positions.items():
                READ_MODEL_POSITION.labels(name, topic, str(partition)).set(offset)
            if heads is None:
                continue
            topics = {names.events(category) for category in read_models.model(name).categories}
            for (topic, partition), head in heads.items():
                if topic in topics:
                    READ_MODEL_LAG.labels(name, topic, str(partition)).set(max(head - positions.get((topic, partition), 0), 0))

    try:
        lock = project_lock()
    except LockError as error:  # the document without the earlier versions; the API serves all else
        log.warning("GET /asyncapi.json leaves out the events' earlier schema versions: %s", error)
        lock = None
    asyncapi = asyncapi_document(settings, registry, lock)  # fixed for the process, like the registry

    @router.get("/asyncapi.json")
    async def get_asyncapi() -> Response:
        return json_response(asyncapi)

    app.include_router(router)
    document(app, settings, registry)
    return app
