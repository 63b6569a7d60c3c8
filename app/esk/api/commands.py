"""POST /v1/{type}/{id}/{command}: how one command comes in over HTTP.

`CommandIntake.submit` validates everything the client sent (id, headers, size, media
type, JSON, payload schema), puts a CommandEnvelope on the commands topic through the
CommandGateway, then waits on the StateReplica for the command's outcome and turns it
into a response (`outcome_response`).

Each command is a `CommandEndpoint`, a plain ASGI endpoint, and `CommandRoutes` sends
its requests there before FastAPI's router and per-request layers see them. Under load
(bench/http_e2e.py) FastAPI's machinery (request objects, dependency solving, response
wrappers) cost more CPU than the command's own work (docs/benchmarks.md, probes). The API process is what limits HTTP throughput. The endpoints are documented
in /openapi.json by `http._document_schemas`.
"""

from __future__ import annotations

import json
import logging
import re
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from typing import Any
from urllib.parse import quote

import orjson
from pydantic import ValidationError
from starlette.requests import ClientDisconnect
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from ..domain.aggregate import ALREADY_EXISTS, NOT_FOUND, AggregateType
from ..kafka.partitioner import partition_for
from ..metrics import HTTP_OUTCOME_TIMEOUTS
from ..projections.positions import Position
from ..protocol import STATE_UNUSABLE, UNKNOWN_AGGREGATE_TYPE, UNKNOWN_COMMAND, CommandEnvelope, Outcome, Status, payload_digest
from ..settings import Settings
from .gateway import CommandGateway, KafkaAway
from .history import events_as_current
from .positions import EventPositions
from .problems import Problem
from .replica import StateReplica
from .route import ROUTE_KEY

log = logging.getLogger(__name__)

# If-Match: a version tag, as ETag sends it ("3"), weak or not. The same text is its pattern
# in /openapi.json.
VERSION_TAG_PATTERN = r'^(?:W/)?"(\d{1,18})"$'
_VERSION_TAG = re.compile(VERSION_TAG_PATTERN)
MAX_ID = 200
# A URL path segment that is "." or ".." is removed by clients before sending (RFC 3986,
# 5.2.4), so no such id could be addressed.
_DOT_SEGMENTS = (".", "..")


class IdRule:
    """What an id may be, as one regular expression: the check and /openapi.json say the same.

    A regular expression because it is what an OpenAPI document can state, and so what a
    client generated from it checks before sending."""

    def __init__(self, kind: str, pattern: str, what: str, example: str) -> None:
        self.kind = kind
        self.pattern = pattern
        self.what = what
        self.example = example
        self._regex = re.compile(pattern)

    def check(self, value: str) -> None:
        if self._regex.fullmatch(value) is None or value in _DOT_SEGMENTS:
            raise Problem(400, f"invalid_{self.kind}", f"{self.kind} must be {self.what}")

    def schema(self) -> dict[str, Any]:
        return {
            "type": "string",
            "minLength": 1,
            "maxLength": MAX_ID,
            "pattern": self.pattern,
            "not": {"enum": list(_DOT_SEGMENTS)},
            "description": self.what,
            "examples": [self.example],
        }


# An aggregate id travels as one path segment: any characters but controls and "/" (which
# would split it), percent-encoded by the client. Nor U+FFFD: bytes that are not UTF-8
# arrive decoded as it, so that ids that differ would name one aggregate.
AGGREGATE_ID = IdRule(
    "aggregate_id",
    rf"^[^\x00-\x1f\x7f-\x9f/\ufffd]{{1,{MAX_ID}}}$",
    f"1 to {MAX_ID} UTF-8 characters, none of them a control character, '/' or U+FFFD, and not '.' or '..'",
    "acc-42",
)
# A command id travels in the Idempotency-Key header, where HTTP allows visible ASCII and
# inner spaces (leading and trailing ones are not part of a field value), and back in
# /v1/commands/{command_id}.
COMMAND_ID = IdRule(
    "idempotency_key",
    rf"^[\x21-\x7e](?:[\x20-\x7e]{{0,{MAX_ID - 2}}}[\x21-\x7e])?$",
    f"1 to {MAX_ID} visible ASCII characters or inner spaces, and not '.' or '..'",
    "deposit-7f3a9c",
)
# X-Correlation-Id and X-Causation-Id are copied onto each of the command's events: held
# to an id's size, as the Idempotency-Key is.
TRACE_ID = IdRule(
    "trace_id",
    rf"^[\x21-\x7e](?:[\x20-\x7e]{{0,{MAX_ID - 2}}}[\x21-\x7e])?$",
    f"1 to {MAX_ID} visible ASCII characters or inner spaces",
    "req-5f1c2e",
)


def command_location(command_id: str) -> str:
    """Where a command's outcome is read; the id may hold characters a path must escape."""
    return f"/v1/commands/{quote(command_id, safe='')}"


def command_url(aggregate_type: AggregateType[Any], name: str) -> str:
    """The route of a command, as mounted and as documented."""
    return f"/v1/{aggregate_type.name}/{{id}}/{name}"


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(body), status_code=status, headers=headers, media_type="application/json")


POSITION_HEADER = "Esk-Position"
# The 422 code of a command whose Idempotency-Key is that of another command.
IDEMPOTENCY_KEY_REUSED = "idempotency_key_reused"


def etag(version: int) -> dict[str, str]:
    return {"ETag": f'"{version}"'}


def outcome_response(outcome: Outcome, aggregate: AggregateType[Any] | None, position: Position | None = None) -> Response:
    """The HTTP answer to a command's outcome, the same wherever it is asked for; an accepted
    one with its events as this code's schemas have them (an outcome stored by an older
    release, a retry answered after an upgrade, holds older ones), and the position of its
    events when it is known (read-your-writes)."""
    if outcome.status is Status.ACCEPTED:
        body = {
            "command_id": outcome.command_id,
            "type": outcome.aggregate_type,
            "id": outcome.aggregate_id,
            "version": outcome.version,
            "events": events_as_current(aggregate, outcome.events, f"the outcome of command {outcome.command_id!r}"),
            "position": None if position is None else position.as_json(),
        }
        headers = etag(outcome.version) | ({} if position is None else {POSITION_HEADER: position.token()})
        return json_response(body, 200, headers)
    extra = {"command_id": outcome.command_id, "current_version": outcome.version}
    headers = etag(outcome.version) if outcome.version > 0 else {}
    code = outcome.code or ("precondition_failed" if outcome.status is Status.PRECONDITION_FAILED else "rejected")
    return Problem(outcome_status(outcome), code, outcome.detail or "", headers, **extra).response()


def outcome_status(outcome: Outcome) -> int:
    """The HTTP status of the answer to a command's outcome."""
    if outcome.status is Status.ACCEPTED:
        return 200
    if outcome.status is Status.PRECONDITION_FAILED:
        return 412
    return _REFUSED_STATUS.get(outcome.code or "", 422)


# Refusals whose status is not a domain rejection's 422: the processor's of a command whose
# type or name its code does not have (a command queued before a release removed it) are
# the API's own 404s for them.
_REFUSED_STATUS = {
    NOT_FOUND: 404, UNKNOWN_COMMAND: 404, UNKNOWN_AGGREGATE_TYPE: 404, ALREADY_EXISTS: 409, STATE_UNUSABLE: 500,
}


def _another_command(outcome: Outcome, aggregate_type: AggregateType[Any], aggregate_id: str, command: str, digest: str) -> str | None:
    """Which other command `outcome` is of, under the same id ("deposit on accounts/a1 with
    another payload"); None when it is this command's, with this payload (its `digest`), on
    the aggregate. An outcome of a release that kept no digest is told by the command and
    aggregate alone."""
    same_command = (outcome.aggregate_type, outcome.aggregate_id, outcome.command) == (aggregate_type.name, aggregate_id, command)
    other_payload = outcome.payload_digest not in (None, digest)
    if same_command and not other_payload:
        return None
    # "with another payload" only where it is all that differs: said of another command, it
    # reads as if the command were the same
    return f"{outcome.command} on {outcome.aggregate_type}/{outcome.aggregate_id}{' with another payload' if same_command else ''}"


def _refuse_another_command(outcome: Outcome, aggregate_type: AggregateType[Any], aggregate_id: str, command: str, digest: str) -> None:
    """422 when `outcome`, under this command's Idempotency-Key, is another command's."""
    if (other := _another_command(outcome, aggregate_type, aggregate_id, command, digest)) is not None:
        raise Problem(
            422, IDEMPOTENCY_KEY_REUSED,
            f"the Idempotency-Key {outcome.command_id!r} is that of {other}: a new command needs a key of its own",
            command_id=outcome.command_id,
        )


class SubmittedCommands:
    """The ids of the commands this API instance put on the commands topic, for a while:
    until one's outcome is in it is pending, and GET /v1/commands/{id} answers 202 for it
    (the Location of a 202 `respond-async`, or of a 503 `outcome_pending`), not 404.

    Held for `HOLD_S` and at most `MAX_HELD` ids, the oldest let go first: an id let go
    reads 404 until its outcome is in, as one submitted through another instance does."""

    HOLD_S = 3600.0
    MAX_HELD = 100_000

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._held: OrderedDict[str, float] = OrderedDict()  # id -> when it was submitted

    def add(self, command_id: str) -> None:
        self._held[command_id] = self._clock()
        self._held.move_to_end(command_id)
        self._let_go()

    def discard(self, command_id: str) -> None:
        self._held.pop(command_id, None)

    def __contains__(self, command_id: object) -> bool:
        self._let_go()
        return command_id in self._held

    def __len__(self) -> int:
        return len(self._held)

    def _let_go(self) -> None:
        oldest = self._clock() - self.HOLD_S
        while self._held and (len(self._held) > self.MAX_HELD or next(iter(self._held.values())) < oldest):
            self._held.popitem(last=False)


class CommandIntake:
    """Takes commands in for one API instance; remembers the ones it submitted whose
    outcome it has not seen (`submitted`), so that GET /v1/commands/{id} can answer 202."""

    def __init__(self, settings: Settings, gateway: CommandGateway, replica: StateReplica, positions: EventPositions) -> None:
        self.settings = settings
        self.gateway = gateway
        self.replica = replica
        self.positions = positions
        self.submitted = SubmittedCommands()

    async def submit(
        self, aggregate_type: AggregateType[Any], aggregate_id: str, name: str, headers: Mapping[str, str], receive: Receive
    ) -> Response:
        api = self.settings.api
        AGGREGATE_ID.check(aggregate_id)
        payload = await read_json(headers, receive, api.max_body_bytes)
        try:
            # Strictly, from JSON text: a payload is valid as its schema in /openapi.json says,
            # so "5" or true is not an integer here (pydantic's lax mode would take them).
            aggregate_type.commands[name].model_validate_json(orjson.dumps(payload), strict=True)
        except ValidationError as error:
            errors = [{"loc": list(e["loc"]), "msg": e["msg"], "type": e["type"]} for e in error.errors()]
            raise Problem(422, "invalid_payload", f"the {name} payload is invalid", errors=errors) from None
        expected_version, expect_new = preconditions(headers)
        # A key that is there but empty is refused like any other invalid key: it is not
        # the same as sending none.
        key = headers.get("idempotency-key")
        command_id = uuid.uuid4().hex if key is None else key
        COMMAND_ID.check(command_id)
        correlation_id, causation_id = _trace_id(headers, "x-correlation-id"), _trace_id(headers, "x-causation-id")
        location = command_location(command_id)

        # A retry whose outcome is known already is answered without touching Kafka.
        known = self.replica.outcome(command_id)
        digest = payload_digest(payload)
        if known is not None:
            # a key reused for a new command: answering with the first one's outcome would
            # tell of another aggregate, command or payload
            _refuse_another_command(known, aggregate_type, aggregate_id, name, digest)
            return outcome_response(known, aggregate_type, await self.positions.of(known))
        envelope = CommandEnvelope(
            command_id=command_id,
            aggregate_type=aggregate_type.name,
            aggregate_id=aggregate_id,
            command=name,
            payload=payload,
            expected_version=expected_version,
            expect_new=expect_new,
            correlation_id=correlation_id or command_id,
            causation_id=causation_id,
        )
        try:
            await self.gateway.submit(envelope)
        except Exception as error:  # not acknowledged: the client must retry (same Idempotency-Key)
            if isinstance(error, KafkaAway):  # the gateway said so once, not for each command
                log.debug("command %s not tried: %s", command_id, error)
            else:
                log.warning("could not submit command %s: %r", command_id, error)
            # `Location` names the command's id, its key: a client that sent none retries
            # under it, as the record may be stored after all (a send that timed out).
            raise Problem(
                503, "kafka_unavailable",
                "the command was not acknowledged (it may or may not be stored); retry with the same Idempotency-Key",
                {"Retry-After": str(api.retry_after_s), "Location": location},
            ) from None
        self.submitted.add(command_id)
        if "respond-async" in headers.get("prefer", "").lower():  # preference names are case-insensitive (RFC 7240)
            return json_response(
                {"command_id": command_id, "status": "pending"},
                202,
                {"Location": location, "Preference-Applied": "respond-async"},
            )
        partitions = self.gateway.commands_partitions()
        ours = None if partitions is None else partition_for(envelope.key, partitions)

        def decides(found: Outcome) -> bool:
            """Whether `found`, under this command's id, is its outcome or tells its fate.
            Under a key reused while the first command was in flight, that one's outcome
            may come first: on an aggregate of the same partition (the same aggregate, or
            another whose id lands there) this one is then dropped as its duplicate, and is
            refused here; on another partition it is processed there, and its own outcome
            is waited for."""
            if (found.aggregate_type, found.aggregate_id) == (aggregate_type.name, aggregate_id):
                return True
            return partitions is not None and partition_for(found.aggregate_id.encode(), partitions) == ours

        outcome = await self.replica.wait_outcome(command_id, decides, api.outcome_timeout_s)
        if outcome is None:
            HTTP_OUTCOME_TIMEOUTS.inc()
            raise Problem(
                503, "outcome_pending",
                "the command is stored and its outcome is not in yet: retry with the same Idempotency-Key for it",
                {"Retry-After": str(api.retry_after_s), "Location": location},
                command_id=command_id,
            )
        self.submitted.discard(command_id)
        _refuse_another_command(outcome, aggregate_type, aggregate_id, name, digest)
        return outcome_response(outcome, aggregate_type, await self.positions.of(outcome))


class CommandEndpoint:
    """The ASGI endpoint of one command of one aggregate type."""

    def __init__(self, intake: CommandIntake, aggregate_type: AggregateType[Any], name: str) -> None:
        self.intake = intake
        self.aggregate_type = aggregate_type
        self.name = name
        self.route = command_url(aggregate_type, name)

    async def __call__(self, scope: Scope, receive: Receive, send: Send, aggregate_id: str) -> None:
        try:
            response = await self.intake.submit(self.aggregate_type, aggregate_id, self.name, request_headers(scope), receive)
        except Problem as problem:
            response = problem.response()
        except ClientDisconnect:
            return  # nobody to answer; a command already submitted is processed all the same
        await response(scope, receive, send)


class CommandRoutes:
    """ASGI middleware: `POST /v1/{type}/{id}/{command}` of a registered command goes to
    its CommandEndpoint; everything else, unknown commands included, to the wrapped app.
    The path is matched as Starlette's router would (decoded, `{id}` one segment)."""

    def __init__(self, app: ASGIApp, endpoints: Iterable[CommandEndpoint]) -> None:
        self.app = app
        self.endpoints = {(e.aggregate_type.name, e.name): e for e in endpoints}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and _escaped_slash_in_id(scope):
            # decoded, "a%2Fb" would be two segments and so another route (405, or a bare 404):
            # no aggregate has such an id, and the answer says why
            await Problem(404, "not_found", f"no aggregate has an id with '/' in it (an id is {AGGREGATE_ID.what})").response()(
                scope, receive, send
            )
            return
        if scope["type"] == "http" and scope["method"] == "POST":
            parts = scope["path"].split("/")
            if len(parts) == 5 and parts[0] == "" and parts[1] == "v1" and parts[3]:
                endpoint = self.endpoints.get((parts[2], parts[4]))
                if endpoint is not None:
                    scope[ROUTE_KEY] = endpoint.route  # the request's span is named after it
                    await endpoint(scope, receive, send, parts[3])
                    return
        await self.app(scope, receive, send)


def _trace_id(headers: Mapping[str, str], name: str) -> str | None:
    """The header's value, checked (400 `invalid_trace_id`); None when it is not there."""
    value = headers.get(name)
    if value is not None:
        TRACE_ID.check(value)
    return value


def _escaped_slash_in_id(scope: Scope) -> bool:
    """Whether the request's path holds an aggregate id with "/" escaped in it
    (`/v1/{type}/{id}...`; a command id, `/v1/commands/{id}`, may hold one)."""
    raw = scope.get("raw_path")
    if not raw:  # a server that gives none: the decoded path cannot tell "/" from "%2F"
        return False
    parts = raw.split(b"?", 1)[0].split(b"/")
    return len(parts) >= 4 and parts[1] == b"v1" and parts[2] not in (b"commands", b"projections") and b"%2f" in parts[3].lower()


# The headers a command takes one value of, and the problem of one given twice: the two
# may differ, and another reader of the request (a proxy, a log) may take the other.
_ONE_VALUE = {
    "idempotency-key": (400, "invalid_idempotency_key"),
    "if-match": (400, "invalid_if_match"),
    "if-none-match": (400, "invalid_if_none_match"),
    "x-correlation-id": (400, "invalid_trace_id"),
    "x-causation-id": (400, "invalid_trace_id"),
    "content-type": (415, "unsupported_media_type"),
    "content-encoding": (415, "unsupported_media_type"),
}


def request_headers(scope: Scope) -> dict[str, str]:
    """The request's headers by lower-case name, looked up once (a Starlette `Headers.get`
    scans the whole list on every call): the first of repeated ones, but a header a command
    takes one value of, given twice, is a Problem."""
    headers: dict[str, str] = {}
    for raw_name, raw_value in scope["headers"]:
        name = raw_name.decode("latin-1")
        if name not in headers:
            headers[name] = raw_value.decode("latin-1")
        elif name in _ONE_VALUE:
            status, code = _ONE_VALUE[name]
            raise Problem(status, code, f"{name.title()} is given more than once: send it once")
    return headers


async def read_json(headers: Mapping[str, str], receive: Receive, limit: int) -> dict[str, Any]:
    """The body's JSON object (an empty body is `{}`), its numbers as `_json_numbers` reads them."""
    length = headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise Problem(413, "body_too_large", f"the body may have at most {limit} bytes")
    body = bytearray()
    more = True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        body += message.get("body", b"")
        if len(body) > limit:
            raise Problem(413, "body_too_large", f"the body may have at most {limit} bytes")
        more = message.get("more_body", False)
    if not body.strip():
        return {}
    media_type, _, parameters = headers.get("content-type", "").partition(";")
    media_type = media_type.strip().lower()
    if media_type != "application/json" and not (media_type.startswith("application/") and media_type.endswith("+json")):
        raise Problem(415, "unsupported_media_type", "send the command as application/json")
    # JSON is UTF-8 (RFC 8259): a body said to be in another charset, or compressed, would
    # be read as what it is not
    charset = next((value.strip().strip('"').lower() for key, _, value in (p.partition("=") for p in parameters.split(";"))
                    if key.strip().lower() == "charset"), "utf-8")
    encoding = headers.get("content-encoding", "identity").strip().lower()
    if charset not in ("utf-8", "utf8") or encoding not in ("", "identity"):
        raise Problem(415, "unsupported_media_type", "send the command as application/json, in UTF-8 and not compressed")
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError as error:
        raise Problem(400, "malformed_json", f"the body is not valid JSON: {error}") from None
    if not isinstance(payload, dict):
        raise Problem(422, "invalid_payload", "the body must be a JSON object")
    numbers: dict[str, Any] = _json_numbers(payload)  # first: it refuses what nests too deep for the look below
    if (twice := _name_given_twice(body)) is not None:
        raise Problem(400, "malformed_json", f"the body gives {twice!r} twice in one object: which one was meant cannot be told")
    return numbers


def preconditions(headers: Mapping[str, str]) -> tuple[int | None, bool]:
    """If-Match: "<version>" (optimistic concurrency) and If-None-Match: * (must be new)."""
    if_match = headers.get("if-match")
    if_none_match = headers.get("if-none-match")
    expected: int | None = None
    if if_match is not None:
        match = _VERSION_TAG.match(if_match.strip())
        if match is None:
            raise Problem(400, "invalid_if_match", 'If-Match must be a version tag such as "3"')
        expected = int(match.group(1))
    if if_none_match is not None and if_none_match.strip() != "*":
        raise Problem(400, "invalid_if_none_match", "only If-None-Match: * is supported (the aggregate must not exist)")
    return expected, if_none_match is not None


_INT64_MIN, _INT64_END = -(2**63), 2**63


class _GivenTwice(Exception):
    pass


def _unique_names(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    members = dict(pairs)
    if len(members) < len(pairs):
        seen: set[str] = set()
        for name, _ in pairs:
            if name in seen:
                raise _GivenTwice(name)
            seen.add(name)
    return members


_PAIRS = json.JSONDecoder(object_pairs_hook=_unique_names)  # made once: json.loads with a hook makes one a call


def _name_given_twice(body: bytes | bytearray) -> str | None:
    """A member name given twice in one of the (valid) JSON body's objects: orjson keeps the
    last; another reader of the same body (a proxy that checks it, a log) may take the first,
    so a body such as {"amount": 1, "amount": 1000} is refused, not read one way (I-JSON,
    RFC 7493). Python's own parser is the one that hands over every pair."""
    if body.count(b":") < 2:  # each name is followed by one: no two names
        return None
    try:
        _PAIRS.decode(body.decode())  # UTF-8: orjson read it; nested no deeper than MAX_DEPTH
    except _GivenTwice as twice:
        return str(twice)
    return None


# Arrays and objects a command's body may nest: far past any payload model's, well within
# what Python's parsers and esk's walks of it recurse through (orjson reads 1,024).
MAX_DEPTH = 64


def _json_numbers(value: Any, depth: int = 0) -> Any:
    """`value` with its numbers as JSON Schema and esk's records read them: a whole number
    within 64 bits is an int (5.0 is the integer 5), any other number a float. Strict
    validation then takes an integer field as the document states it (format int64), and a
    float field as ever. Nested deeper than MAX_DEPTH: 400."""
    if isinstance(value, float):
        return int(value) if value.is_integer() and _INT64_MIN <= value < _INT64_END else value
    if isinstance(value, int) and not isinstance(value, bool):
        return value if _INT64_MIN <= value < _INT64_END else float(value)
    if isinstance(value, (dict, list)) and depth >= MAX_DEPTH:
        raise Problem(400, "malformed_json", f"the body nests its arrays and objects deeper than {MAX_DEPTH} levels")
    if isinstance(value, dict):
        return {key: _json_numbers(item, depth + 1) for key, item in value.items()}
    if isinstance(value, list):
        return [_json_numbers(item, depth + 1) for item in value]
    return value
