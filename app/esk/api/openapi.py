"""/openapi.json: every operation of the HTTP API with every answer it really gives
(docs/product.md), for clients generated in any language.

The document is written here rather than derived by FastAPI from the routes' signatures:
the command endpoints are not FastAPI routes, the server checks ids, headers and bodies
itself (a 400 with a problem code, not FastAPI's 422), and every error is
application/problem+json. tests/api/test_openapi_conformance.py holds the document to what
a live server answers (schemathesis, all checks).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel

from ..domain.aggregate import AggregateType, Event
from ..domain.json_schema import model_schema
from ..kafka.topics import TopicNames
from ..projections.catalog import Projection, configured_read_models
from ..projections.reader import DECIMAL_TEXT
from ..protocol import MAX_VERSION, STATE_UNUSABLE, Status
from ..registry import Registry
from ..settings import Settings
from .commands import (
    AGGREGATE_ID,
    COMMAND_ID,
    IDEMPOTENCY_KEY_REUSED,
    POSITION_HEADER,
    TRACE_ID,
    VERSION_TAG_PATTERN,
    command_url,
)
from .problems import FIELD_ERROR_SCHEMA, PROBLEM_JSON, PROBLEM_SCHEMA

log = logging.getLogger(__name__)

# Query parameters of a read model's rows that are not filters on its columns.
READ_PARAMETERS = frozenset({"limit", "after", "wait_ms"})

Schema = dict[str, Any]
JSON = "application/json"


def _ref(name: str) -> Schema:
    return {"$ref": f"#/components/schemas/{name}"}


def _string() -> Schema:
    return {"type": "string"}


def _count(minimum: int = 0) -> Schema:
    return {"type": "integer", "minimum": minimum}


def _example(schema: Schema, example: Any) -> Schema:
    return schema | {"examples": [example]}


def _object(properties: Schema, description: str = "") -> Schema:
    """A response object: every property is always there."""
    schema: Schema = {"type": "object", "required": list(properties), "properties": properties}
    if description:
        schema["description"] = description
    return schema


# -- answers -------------------------------------------------------------------------


def _header(description: str, schema: Schema, required: bool = True) -> Schema:
    return {"description": description, "required": required, "schema": schema}


def _etag(required: bool = True) -> Schema:
    return _header('The aggregate\'s version as an entity tag, e.g. "3"', {"type": "string", "pattern": r'^"\d+"$'}, required)


def _retry_after(required: bool = True) -> Schema:
    return _header("Seconds to wait before trying again", _count(), required)


def _location(description: str, required: bool = True) -> Schema:
    return _header(description, {"type": "string", "format": "uri-reference"}, required)


def _answer(description: str, schema: Schema, media_type: str = JSON, headers: Schema | None = None) -> Schema:
    answer: Schema = {"description": description, "content": {media_type: {"schema": schema}}}
    if headers:
        answer["headers"] = headers
    return answer


def _problem(description: str, *codes: str, headers: Schema | None = None) -> Schema:
    """A problem answer; `codes` are all the codes it can carry (none: an open set, such as a
    domain's rejections)."""
    schema = _ref("Problem")
    if codes:
        schema = {"allOf": [schema, {"properties": {"code": {"enum": list(codes)}}}]}
        description = f"{description} (code: {', '.join(codes)})"
    return _answer(description, schema, PROBLEM_JSON, headers)


def _unusable_read_models(*more_codes: str) -> Schema:
    waited = ", has not reached the positions asked for in time (not_caught_up)" if "not_caught_up" in more_codes else ""
    return _problem(
        f"The read model is not built yet (run `esk project run <name>`){waited}, or read models cannot be served here",
        "projection_not_built", "projections_unavailable", "read_models_misconfigured", *more_codes,
        headers={"Retry-After": _retry_after(required=False)},
    )


# -- parameters ----------------------------------------------------------------------


def _parameter(name: str, where: str, schema: Schema, description: str = "", required: bool = False) -> Schema:
    parameter: Schema = {"name": name, "in": where, "required": required or where == "path", "schema": schema}
    if description:
        parameter["description"] = description
    return parameter


def _aggregate_path_parameters(registry: Registry) -> list[Schema]:
    return [
        _parameter("type_name", "path", {"type": "string", "enum": sorted(registry)}, "An aggregate type"),
        _parameter("id", "path", AGGREGATE_ID.schema(), "The aggregate's id"),
    ]


_COMMAND_HEADERS = [
    # The format says what the value is (an RFC 9110 entity-tag); the pattern narrows it to
    # esk's version tags.
    _parameter(
        "If-Match", "header", _example({"type": "string", "format": "entity-tag", "pattern": VERSION_TAG_PATTERN}, '"3"'),
        'Optimistic concurrency: the version the command expects, as the ETag gives it: "3" (or W/"3").',
    ),
    _parameter("If-None-Match", "header", {"type": "string", "enum": ["*"]}, "`*`: the aggregate must not exist yet."),
    _parameter(
        "Idempotency-Key", "header", COMMAND_ID.schema(),
        "The command id: a retry with the same key gets the first outcome. Default: a new id.",
    ),
    _parameter("Prefer", "header", _string(), "`respond-async`: answer 202 once the command is stored, without waiting."),
    _parameter("X-Correlation-Id", "header", TRACE_ID.schema(), "Copied onto the events (default: the command id)."),
    _parameter(
        "X-Causation-Id", "header", TRACE_ID.schema(),
        "What caused the command (e.g. an event's id), kept with it; its events' causation is the command.",
    ),
]


# -- components ----------------------------------------------------------------------


def _components() -> Schema:
    """The framework's own schemas; a domain's are named `<type>.<Model>`, never clashing."""
    recorded_event = {
        "event_id": _string(),
        "type": _string(),
        "version": _count(1),
        "schema_version": _count(1),
        "data": {"type": "object", "description": "The event's payload: the schema `<aggregate type>.events.<type>`"},
        "recorded_at": {"type": "integer", "description": "Milliseconds since the epoch"},
    }
    return {
        "Problem": PROBLEM_SCHEMA,
        "FieldError": FIELD_ERROR_SCHEMA,
        "RecordedEvent": _object(recorded_event, "An event as the command that emitted it recorded it"),
        "HistoryEvent": _object(
            recorded_event | {"command_id": _string()},
            "An event of an aggregate's history; `data` in its type's current schema (`schema_version`) where the "
            "domain's upcasters bring it there",
        ),
        "CommandAccepted": _object({
            "command_id": _string(),
            "type": _string(),
            "id": _string(),
            "version": _count(1),
            "events": {"type": "array", "items": _ref("RecordedEvent")},
            "position": {
                "oneOf": [_ref("Position"), {"type": "null"}],
                "description": "Where its events are: a read of a read model or of a history given it (`after`) "
                "reflects this command; null when it could not be told in time",
            },
        }, "The command was accepted: the aggregate's new version and the events it emitted"),
        "Position": _object({
            "topic": _string(),
            "partition": _count(),
            "offset": _count(),
            "token": {"type": "string", "description": "`<topic>/<partition>/<offset>`, for `after`"},
        }, "A position in an events topic: every event of the command lies below `offset` on that partition"),
        "CommandPending": _object({"command_id": _string(), "status": {"type": "string", "enum": ["pending"]}}),
        "CommandOutcome": _object({
            "command_id": _string(),
            "aggregate_type": _string(),
            "aggregate_id": _string(),
            "command": _string(),
            "status": {"type": "string", "enum": [s.value for s in Status]},
            "version": _count(),
            "events": {"type": "array", "items": _ref("RecordedEvent")},
            "code": {"type": ["string", "null"]},
            "detail": {"type": ["string", "null"]},
            "processed_at": {"type": "integer", "description": "Milliseconds since the epoch"},
            "payload_digest": {
                "type": ["string", "null"],
                "description": "A digest of the command's payload: a retry under its Idempotency-Key must carry the same payload",
            },
            "http_status": {"type": "integer", "description": "What the command's POST answered, or would have"},
        }, "The outcome of a command"),
        "Aggregate": _object({
            "type": _string(),
            "id": _string(),
            "version": _count(1),
            "state": {"type": "object"},
            "unusable": {
                "type": ["string", "null"],
                "description": "Why its commands are refused (500 state_unusable): its events do not fold into the current "
                "state model, and `state` is the one it had; null when it is usable",
            },
        }),
        "History": _object({
            "type": _string(),
            "id": _string(),
            "events": {"type": "array", "items": _ref("HistoryEvent"), "description": "In version order"},
            "next_version": {
                "type": ["integer", "null"], "minimum": 2,
                "description": "The version the next page starts at (its `from_version`); null on the history's last page",
            },
            "positions": {"type": "array", "items": _ref("Position"), "description": "What the events reflect"},
        }),
        "Status": _object({"status": _string()}),
    }


def _schema_name(aggregate_type: AggregateType[Any], model: type) -> str:
    return f"{aggregate_type.name}.{model.__name__}"


def _domain_components(registry: Registry) -> Schema:
    """Every command's, event's (with `x-schema-version`) and state's schema."""
    components: Schema = {}
    for aggregate_type in registry.values():
        models: list[tuple[str, type[BaseModel]]] = [(_schema_name(aggregate_type, m), m) for m in aggregate_type.commands.values()]
        models += [(_event_schema_name(aggregate_type, e), e) for e in aggregate_type.events]
        models.append((f"{aggregate_type.name}.State", aggregate_type.state))
        for name, documented in models:
            schema = model_schema(documented, ref_template=f"#/components/schemas/{name}.{{model}}")
            for def_name, definition in schema.pop("$defs", {}).items():
                components[f"{name}.{def_name}"] = definition
            if issubclass(documented, Event):
                schema["x-schema-version"] = documented.schema_version
            components[name] = schema
    return components


def _int64(schema: Any) -> Any:
    """`schema` with every integer marked int64: what esk's records (JSON through orjson,
    Spark's bigint) carry, and all the API takes for one."""
    if isinstance(schema, list):
        return [_int64(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    marked = {key: _int64(value) for key, value in schema.items()}
    types = schema.get("type")
    if (types == "integer" or (isinstance(types, list) and "integer" in types)) and "format" not in schema:
        marked["format"] = "int64"
    return marked


def _event_schema_name(aggregate_type: AggregateType[Any], event: type[Event]) -> str:
    return f"{aggregate_type.name}.events.{event.type_name()}"


# -- operations ----------------------------------------------------------------------


def _command_operation(aggregate_type: AggregateType[Any], name: str, model: type[BaseModel]) -> Schema:
    # Each emitted event's `data` is the schema of its type: `type` tells which one it is.
    events = {
        "oneOf": [
            {"properties": {"type": {"const": e.type_name()}, "data": _ref(_event_schema_name(aggregate_type, e))}}
            for e in aggregate_type.events
        ]
    }
    accepted = {"allOf": [_ref("CommandAccepted"), {"properties": {"events": {"items": events}}}]}
    optional_etag = {"ETag": _etag(required=False)}
    outcome = {"operationId": "get_command", "parameters": {"command_id": "$response.body#/command_id"}}
    # What an answer leads to: the aggregate's state, the outcome, and the type's next
    # commands at the version the answer tells.
    follow_ups = {
        "outcome": outcome,
        "state": {"operationId": "get_aggregate", "parameters": {"type_name": aggregate_type.name, "id": "$response.body#/id"}},
    } | {
        f"then_{other}": {
            "operationId": _operation_id(aggregate_type, other),
            "parameters": {"id": "$response.body#/id", "header.If-Match": "$response.header.ETag"},
        }
        for other in aggregate_type.commands
        if other != name
    }
    return {
        "tags": [aggregate_type.name],
        "summary": f"{name} ({model.__name__})",
        "description": model.__doc__ or "",
        "operationId": _operation_id(aggregate_type, name),
        "parameters": [_parameter("id", "path", AGGREGATE_ID.schema(), "The aggregate's id"), *_COMMAND_HEADERS],
        "requestBody": {
            # No body is the empty object, which is all a command without required fields needs.
            "required": any(field.is_required() for field in model.model_fields.values()),
            "content": {JSON: {"schema": _ref(_schema_name(aggregate_type, model))}},
        },
        "responses": {
            "200": _answer(
                "Accepted: the new version and the events", accepted,
                headers={"ETag": _etag(), POSITION_HEADER: _header("The position's token, when it is known", {"type": "string"}, False)},
            ) | {"links": follow_ups},
            "202": _answer(
                "Stored; its outcome will be at the Location (Prefer: respond-async)", _ref("CommandPending"),
                headers={
                    "Location": _location("The command's outcome: /v1/commands/{command_id}"),
                    "Preference-Applied": _header("The preference honoured", {"type": "string", "enum": ["respond-async"]}),
                },
            ) | {"links": {"outcome": outcome}},
            "400": _problem(
                "An invalid id, header or JSON body",
                "invalid_aggregate_id", "invalid_idempotency_key", "malformed_json", "invalid_if_match", "invalid_if_none_match", "invalid_trace_id",
            ),
            "404": _problem("The aggregate does not exist (and the command does not create one)", "not_found"),
            "409": _problem("The aggregate exists already (a creating command)", "already_exists", headers=optional_etag),
            "412": _problem("If-Match or If-None-Match failed; the current version is in the body", "precondition_failed", headers=optional_etag),
            "413": _problem("The body is too large", "body_too_large"),
            "415": _problem("The body is not JSON (application/json or application/*+json) in UTF-8, uncompressed", "unsupported_media_type"),
            "422": _problem(
                "Refused by the domain (its own code), an invalid payload (`invalid_payload`, with `errors`), "
                f"the domain code failed (`domain_error`), or the Idempotency-Key is another command's (`{IDEMPOTENCY_KEY_REUSED}`)",
                headers=optional_etag,
            ),
            "500": _problem(
                "The aggregate's stored state cannot be used by the current state model: its events do not fold "
                "into it (a fault of the service, named in `detail`; `esk state unusable` lists such aggregates)",
                STATE_UNUSABLE,
                headers=optional_etag,
            ),
            "503": _problem(
                "Not acknowledged, stored or not: retry with the same Idempotency-Key, or the id the Location names "
                "(`kafka_unavailable`); or stored, with no outcome in time: it will be processed, its outcome will be "
                "at the Location (`outcome_pending`)",
                "kafka_unavailable", "outcome_pending",
                headers={"Retry-After": _retry_after(), "Location": _location("The command's outcome", required=False)},
            ),
        },
    }


def _operation_id(aggregate_type: AggregateType[Any], command: str) -> str:
    return f"{aggregate_type.name}_{command}"


def _aggregate_operation(registry: Registry) -> Schema:
    return {
        "tags": ["state"],
        "summary": "Current state and version of an aggregate",
        "operationId": "get_aggregate",
        "parameters": [
            *_aggregate_path_parameters(registry),
            _parameter(
                "min_version", "query", _example(_count(), 3),
                "Wait until at least this version is visible here (read-your-writes from any API instance).",
            ),
        ],
        "responses": {
            "200": _answer("The aggregate", _ref("Aggregate"), headers={"ETag": _etag()}),
            "400": _problem("An invalid id or min_version", "invalid_aggregate_id", "invalid_min_version"),
            "404": _problem("No such aggregate (never existed, or expired), or no such type", "not_found", "unknown_aggregate_type"),
            "422": _problem("min_version is not an integer", "invalid_request"),
            "503": _problem(
                "min_version is not visible here in time; `current_version` is", "version_not_visible",
                headers={"Retry-After": _retry_after()},
            ),
        },
    }


def _history_operation(registry: Registry, topics: TopicNames, page_max: int, partitions: int) -> Schema:
    reads = [topics.events(name) for name in sorted(registry)]
    return {
        "tags": ["state"],
        "summary": "An aggregate's history: its events in version order",
        "description": "From the history index each API instance keeps of the events topics, as far as it has read them "
        "(`positions`); given `after`, once it has read past those positions.",
        "operationId": "get_history",
        "parameters": [
            *_aggregate_path_parameters(registry),
            _parameter("from_version", "query", _count(1) | {"maximum": MAX_VERSION}, "The first version the page holds (default 1)"),
            _parameter(
                "limit", "query", _count(1) | {"maximum": page_max},
                f"Events the page holds at most (default and at most {page_max}, ESK_API__HISTORY_PAGE_MAX)",
            ),
            *_read_after_parameters(reads, "the events", partitions),
        ],
        "responses": {
            "200": _answer(
                "A page of the aggregate's events in version order (empty past its last event), and the positions they reflect",
                _ref("History"),
            ),
            "400": _problem(
                "An invalid id, page, wait or position",
                "invalid_aggregate_id", "invalid_from_version", "invalid_limit", "invalid_wait", "invalid_position",
            ),
            "404": _problem(
                "No events for the aggregate, no such type, or no history index on this API instance (ESK_API__HISTORY=false)",
                "not_found", "unknown_aggregate_type", "history_disabled",
            ),
            "422": _problem("wait_ms, from_version or limit is not an integer", "invalid_request"),
            "503": _problem(
                "The history index is still reading the events topics since the API started (history_catching_up), "
                "or has not reached the positions asked for in time (not_caught_up); `positions` says how far it has read",
                "history_catching_up", "not_caught_up",
                headers={"Retry-After": _retry_after()},
            ),
        },
    }


def _outcome_operation() -> Schema:
    return {
        "tags": ["commands"],
        "summary": "The outcome of a command",
        "operationId": "get_command",
        "parameters": [
            _parameter("command_id", "path", COMMAND_ID.schema(), "The command id (its Idempotency-Key)"),
            _parameter("wait_ms", "query", _count(), "How long to wait for its outcome, when it is not in yet (default 0, at most the API's bound)"),
        ],
        "responses": {
            "200": _answer("The outcome, with the status its POST answered", _ref("CommandOutcome")),
            "202": _answer("Submitted through this API instance within the hour, its outcome not in yet", _ref("CommandPending")),
            "400": _problem("wait_ms below 0, or given twice", "invalid_wait"),
            "422": _problem("wait_ms is not an integer", "invalid_request"),
            "404": _problem(
                "No outcome here (within `wait_ms`): unknown, expired, or not processed yet; a command submitted through "
                "another API instance reads so here until its outcome is in (a read with `wait_ms` waits for it)",
                "unknown_command_id",
            ),
        },
    }


def _operations_paths() -> Schema:
    def status(summary: str, operation_id: str, extra: Schema | None = None) -> Schema:
        answers = {"200": _answer(summary, _ref("Status"))} | (extra or {})
        return {"get": {"tags": ["operations"], "summary": summary, "operationId": operation_id, "responses": answers}}

    return {
        "/healthz": status("The process is up", "healthz"),
        "/readyz": status(
            "The state replica has caught up", "readyz",
            {"503": _problem("Still restoring state from the changelog", "not_ready", headers={"Retry-After": _retry_after()})},
        ),
        "/metrics": {
            "get": {
                "tags": ["operations"],
                "summary": "Metrics in the Prometheus text exposition format",
                "operationId": "metrics",
                "responses": {"200": _answer("The metrics", _string(), "text/plain")},
            }
        },
        "/asyncapi.json": {
            "get": {
                "tags": ["operations"],
                "summary": "The AsyncAPI 3 document of the event topics",
                "operationId": "asyncapi",
                "responses": {"200": _answer("The AsyncAPI document", {"type": "object", "required": ["asyncapi", "channels"]})},
            }
        },
    }


# -- read models ---------------------------------------------------------------------

def _integer(bits: int) -> Schema:
    schema: Schema = {"type": "integer", "minimum": -(2 ** (bits - 1)), "maximum": 2 ** (bits - 1) - 1}
    if bits >= 32:
        schema["format"] = f"int{bits}"
    return schema


# Spark SQL column types a row value and a filter value can be stated for, as the reader
# converts filters (projections/reader.py); a column of another type is not filterable.
_FILTER_TYPES: tuple[tuple[tuple[str, ...], Schema], ...] = (
    (("string", "varchar", "char"), {"type": "string"}),
    (("boolean", "bool"), {"type": "boolean"}),
    (("tinyint", "byte"), _integer(8)),
    (("smallint", "short"), _integer(16)),
    (("int", "integer"), _integer(32)),
    (("bigint", "long"), _integer(64)),
    (("float", "real", "double"), {"type": "number"}),
    (("decimal", "dec", "numeric"), {"type": "string", "pattern": DECIMAL_TEXT.pattern, "description": "A decimal number, exactly"}),
    (("date",), {"type": "string", "format": "date"}),
    (("timestamp", "timestamp_ntz", "timestamp_ltz"), {"type": "string", "format": "date-time"}),
)
_FILTERS = {type_name: schema for type_names, schema in _FILTER_TYPES for type_name in type_names}
_COLUMN = re.compile(r"\s*`?(\w+)`?\s+([A-Za-z_]+)")


def _columns(ddl: str) -> list[tuple[str, str]]:
    """(name, lower-case type name) of each column of a DDL column list; commas inside a
    type's brackets (struct<a:int,b:int>, decimal(10,2)) do not end a column."""
    columns, depth, start = [], 0, 0
    for at, char in enumerate(f"{ddl},"):
        depth += (char in "<(") - (char in ">)")
        if char == "," and depth == 0:
            match = _COLUMN.match(ddl[start:at])
            if match:
                columns.append((match.group(1), match.group(2).lower()))
            start = at + 1
    return columns


# What a row holds of a column no filter is given for (projections/reader.py, _json_value)
_ROW_ONLY: dict[str, Schema] = {"binary": {"type": "string", "contentEncoding": "base64"}}


def _row_value(type_name: str) -> Schema:
    known = _FILTERS.get(type_name) or _ROW_ONLY.get(type_name)
    if known is None:
        return {}  # a struct, an array, a map: as JSON holds them
    value = known | {"type": [known["type"], "null"]}  # a column may be null
    if known.get("format") == "date-time":
        del value["format"]  # a timestamp comes back as ISO text, which may lack its zone
    return value


def _read_after_parameters(reads: Iterable[str], what: str, partitions: int) -> list[Schema]:
    """`after` and `wait_ms` of a read of what follows the events topics `reads`; a position
    on another topic, or on a partition past the topics' (ESK_TOPICS__PARTITIONS, which
    `esk topics init` holds them to), is refused, so the document says which, and offsets
    past Kafka's 64 bits are too. (The pattern stops short of that bound, as a regular
    expression can: 18 digits; no topic comes near it.)"""
    pattern = "|".join(re.escape(topic) for topic in reads)
    numbers = "|".join(str(n) for n in range(partitions))
    return [
        _parameter(
            "after", "query", {"type": "array", "items": {"type": "string", "pattern": rf"^({pattern})/({numbers})/(0|[1-9][0-9]{{0,17}})$"}},
            f"Positions (a command answer's `position.token`) {what} must reflect; the read waits for them",
        ),
        _parameter("wait_ms", "query", _count(), "How long to wait for `after` (default 5000, at most the API's bound)"),
    ]


def _projection_operation(projection: Projection, row_limit: int, topics: TopicNames, partitions: int) -> Schema:
    model = projection.model
    columns = _columns(projection.columns)
    filters = [
        _parameter(name, "query", _FILTERS[type_name], f"Rows whose {name} equals this")
        for name, type_name in columns
        if type_name in _FILTERS and name not in READ_PARAMETERS
    ]
    row = {"type": "object", "properties": {name: _row_value(type_name) for name, type_name in columns}}
    rows = _object({
        "name": {"type": "string", "enum": [model.name]},
        "rows": {"type": "array", "items": row},
        "count": _count(),
        "more": {"type": "boolean", "description": "Whether more rows match than the limit let through"},
        "positions": {"type": "array", "items": _ref("Position"), "description": "What the rows reflect"},
        "parked": {
            "type": "array",
            "items": _object({"aggregate_type": {"type": "string"}, "aggregate_id": {"type": "string"}}),
            "description": "The aggregates the table holds back from an event of theirs that failed the read model on: their rows "
                           "stop before it, whatever the positions (`esk project parked` tells why)",
        },
    })
    order = f", ordered by {', '.join(model.order_by)}" if model.order_by else ""
    return {
        "tags": ["read models"],
        "summary": f"{model.name}: {model.description}",
        "description": f"Rows of the read model's current table where each given column equals its value{order}.",
        "operationId": f"read_model_{model.name}",
        "parameters": [
            _parameter("limit", "query", _example(_count(1), 100), f"At most this many rows (never more than {row_limit})"),
            *_read_after_parameters((topics.events(category) for category in model.categories), "the rows", partitions),
            *filters,
        ],
        "responses": {
            "200": _answer("The rows", rows),
            "400": _problem("An invalid filter value, limit, wait or position", "invalid_filter", "invalid_limit", "invalid_wait",
                            "invalid_position"),
            "422": _problem("limit or wait_ms is not an integer", "invalid_request"),
            "503": _unusable_read_models("not_caught_up"),
        },
    }


def _read_models(settings: Settings) -> Iterable[Projection]:
    """The read models to document; none when they cannot be loaded here (then every read of
    one answers 503, and a document of them would promise what is not served)."""
    try:
        return configured_read_models(settings).values()
    except Exception as error:  # the user's module: whatever it raises, the rest is still documented
        log.warning("read models left out of /openapi.json: %r", error)
        return ()


# -- the document --------------------------------------------------------------------


def _secure(paths: Schema, components: Schema) -> None:
    """Bearer tokens guard every /v1/ operation (api/auth.py)."""
    components["securitySchemes"] = {"bearerAuth": {"type": "http", "scheme": "bearer"}}
    challenge = {"WWW-Authenticate": _header("The scheme to authenticate with", {"type": "string", "enum": ["Bearer"]})}
    for path, item in paths.items():
        if path.startswith("/v1/"):
            for operation in item.values():
                operation["security"] = [{"bearerAuth": []}]
                operation["responses"]["401"] = _problem("No bearer token", "unauthorized", headers=challenge)
                operation["responses"]["403"] = _problem("The token may not call the API", "forbidden")


def document(app: FastAPI, settings: Settings, registry: Registry) -> None:
    """Make `app`'s /openapi.json the whole API: its own routes are left out of FastAPI's."""
    base_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = base_openapi()
        paths: Schema = {}
        for aggregate_type in registry.values():
            for command, model in aggregate_type.commands.items():
                paths[command_url(aggregate_type, command)] = {"post": _command_operation(aggregate_type, command, model)}
        paths["/v1/commands/{command_id}"] = {"get": _outcome_operation()}
        row_limit, topics = settings.projections.api_row_limit, TopicNames(settings.app)
        for projection in _read_models(settings):
            paths[f"/v1/projections/{projection.model.name}"] = {
                "get": _projection_operation(projection, row_limit, topics, settings.topics.partitions)
            }
        paths["/v1/{type_name}/{id}"] = {"get": _aggregate_operation(registry)}
        paths["/v1/{type_name}/{id}/events"] = {
            "get": _history_operation(registry, topics, settings.api.history_page_max, settings.topics.partitions)
        }
        paths |= _operations_paths()
        components = schema.setdefault("components", {})
        components["schemas"] = _int64(components.get("schemas", {}) | _components() | _domain_components(registry))
        if settings.api.auth_tokens:
            _secure(paths, components)
        schema["paths"] = paths
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI documents this way of extending the schema
