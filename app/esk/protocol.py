"""What esk writes on its topics and into its stores, and how it is encoded: JSON via orjson,
of the fields each record lists in `encode` (tests/test_protocol.py checks every field is
there). They are values: nothing changes one after it is made. They are not frozen only
because a frozen dataclass's __init__ costs five times as much, and the processor makes
several of them per command.

- commands topic: key `<id>` (the aggregate id), value `CommandEnvelope`
- `<app>.<type>.events`: key `<id>`, value an event record, headers esk-*
- results topic: key `<id>` (the aggregate id), value `Outcome`
- changelog (and every store): `a/<type>/<id>` -> `StoredAggregate`, `c/<command_id>` -> `Outcome`

Commands, events and outcomes share the aggregate id as key, so the default partitioner
puts all three on the same partition number (the topics have equal partition counts): a
task's transaction touches one partition of each topic it writes, not most of them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import orjson


def _encode(fields: dict[str, Any]) -> bytes:
    # Each record hands over its fields as a dict: orjson serializes that about twice as
    # fast as the slotted dataclass itself (an outcome: 1.7 -> 0.9 us).
    # orjson hands back its whole working buffer (4 KiB for a small document) as the bytes
    # object. Encoded records stay alive for a while (a batch holds thousands until its
    # commit), so each gets a copy of its own size: 20x less memory for half a microsecond.
    return bytes(memoryview(orjson.dumps(fields)))


class DecodeError(ValueError):
    """A record that is not what its topic promises; it goes to the DLQ."""


def now_ms() -> int:
    return int(time.time() * 1000)


def aggregate_key(aggregate_type: str, aggregate_id: str) -> bytes:
    return f"a/{aggregate_type}/{aggregate_id}".encode()


def command_key(command_id: str) -> bytes:
    return f"c/{command_id}".encode()


AGGREGATE_PREFIX = b"a/"
COMMAND_PREFIX = b"c/"
POSITION_PREFIX = b"p/"
EXPIRY_PREFIX = b"x/"
_EXPIRY_DIGITS = 15  # milliseconds, zero-padded so that keys sort by time


def position_key(partition: int) -> bytes:
    """A task's input position: the next commands offset to handle, as of the transaction
    that wrote it (the value is the offset in ASCII digits)."""
    return b"%s%d" % (POSITION_PREFIX, partition)


def expiry_key(expires_at: int, key: bytes) -> bytes:
    """An entry of the expiry index: `x/<expires_at>/<key of what expires>`. The index is
    local to a store: the changelog record of what expires carries its expiry in the
    EXPIRES_AT_HEADER header, and a restore rebuilds the entry from that."""
    return EXPIRY_PREFIX + str(expires_at).zfill(_EXPIRY_DIGITS).encode() + b"/" + key


EXPIRES_AT_HEADER = "esk-expires-at"


def expires_at_header(expires_at: int) -> tuple[str, bytes]:
    return EXPIRES_AT_HEADER, str(expires_at).encode()


def expiry_bound(now: int) -> bytes:
    """Index keys below this bound have expired."""
    return expiry_key(now, b"")


def parse_expiry_key(index_key: bytes) -> tuple[int, bytes]:
    stamp, _, key = index_key[len(EXPIRY_PREFIX):].partition(b"/")
    return int(stamp), key


_REQUIRED_STRINGS = ("command_id", "aggregate_type", "aggregate_id", "command")


@dataclass(slots=True)
class CommandEnvelope:
    command_id: str
    aggregate_type: str
    aggregate_id: str
    command: str
    payload: dict[str, Any]
    expected_version: int | None = None
    expect_new: bool = False
    correlation_id: str | None = None
    causation_id: str | None = None
    submitted_at: int = field(default_factory=now_ms)

    @property
    def key(self) -> bytes:
        return self.aggregate_id.encode()

    def encode(self) -> bytes:
        return _encode({
            "command_id": self.command_id,
            "aggregate_type": self.aggregate_type,
            "aggregate_id": self.aggregate_id,
            "command": self.command,
            "payload": self.payload,
            "expected_version": self.expected_version,
            "expect_new": self.expect_new,
            "correlation_id": self.correlation_id,
            "causation_id": self.causation_id,
            "submitted_at": self.submitted_at,
        })

    @classmethod
    def decode(cls, value: bytes | None) -> CommandEnvelope:
        if value is None:
            raise DecodeError("empty record")
        try:
            data = orjson.loads(value)
        except orjson.JSONDecodeError as error:
            raise DecodeError(f"not JSON: {error}") from None
        if not isinstance(data, dict):
            raise DecodeError("not a JSON object")
        try:
            envelope = cls(**data)
        except TypeError as error:
            raise DecodeError(f"not a command envelope: {error}") from None
        required = (envelope.command_id, envelope.aggregate_type, envelope.aggregate_id, envelope.command)
        for name, given in zip(_REQUIRED_STRINGS, required):
            if not given or not isinstance(given, str):
                raise DecodeError(f"{name} must be a non-empty string")
        if not isinstance(envelope.payload, dict):
            raise DecodeError("payload must be a JSON object")
        if envelope.expected_version is not None and (
            not isinstance(envelope.expected_version, int) or isinstance(envelope.expected_version, bool)
        ):
            raise DecodeError("expected_version must be an integer")
        return envelope


class Status(StrEnum):
    ACCEPTED = "accepted"
    REJECTED = "rejected"
    PRECONDITION_FAILED = "precondition_failed"


@dataclass(slots=True)
class Outcome:
    command_id: str
    aggregate_type: str
    aggregate_id: str
    command: str
    status: Status
    version: int  # the aggregate's version after the command (current version if nothing happened)
    events: list[dict[str, Any]] = field(default_factory=list)
    code: str | None = None
    detail: str | None = None
    processed_at: int = field(default_factory=now_ms)

    def encode(self) -> bytes:
        return _encode({
            "command_id": self.command_id,
            "aggregate_type": self.aggregate_type,
            "aggregate_id": self.aggregate_id,
            "command": self.command,
            "status": self.status,
            "version": self.version,
            "events": self.events,
            "code": self.code,
            "detail": self.detail,
            "processed_at": self.processed_at,
        })

    @classmethod
    def decode(cls, value: bytes) -> Outcome:
        data = orjson.loads(value)
        data["status"] = Status(data["status"])
        return cls(**data)


@dataclass(slots=True)
class StoredAggregate:
    version: int
    state: dict[str, Any]
    updated_at: int  # event time (ms) of the last event
    expires_at: int | None = None  # set once the aggregate is final and its type has a retention

    def encode(self) -> bytes:
        return _encode({
            "version": self.version,
            "state": self.state,
            "updated_at": self.updated_at,
            "expires_at": self.expires_at,
        })

    @classmethod
    def decode(cls, value: bytes) -> StoredAggregate:
        return cls(**orjson.loads(value))


@dataclass(slots=True)
class EventRecord:
    """One event as it stands on `<app>.<type>.events`."""

    event_id: str
    aggregate_type: str
    aggregate_id: str
    version: int
    type: str
    schema_version: int
    data: dict[str, Any]
    command_id: str
    correlation_id: str
    causation_id: str
    recorded_at: int

    def encode(self) -> bytes:
        return _encode({
            "event_id": self.event_id,
            "aggregate_type": self.aggregate_type,
            "aggregate_id": self.aggregate_id,
            "version": self.version,
            "type": self.type,
            "schema_version": self.schema_version,
            "data": self.data,
            "command_id": self.command_id,
            "correlation_id": self.correlation_id,
            "causation_id": self.causation_id,
            "recorded_at": self.recorded_at,
        })

    @classmethod
    def decode(cls, value: bytes) -> EventRecord:
        return cls(**orjson.loads(value))

    def headers(self) -> list[tuple[str, bytes]]:
        return [
            ("esk-event-type", self.type.encode()),
            ("esk-schema-version", str(self.schema_version).encode()),
            ("esk-command-id", self.command_id.encode()),
            ("esk-correlation-id", self.correlation_id.encode()),
            ("esk-causation-id", self.causation_id.encode()),
        ]

    def public(self) -> dict[str, Any]:
        """The event as the HTTP API shows it."""
        return {
            "event_id": self.event_id,
            "type": self.type,
            "version": self.version,
            "schema_version": self.schema_version,
            "data": self.data,
            "recorded_at": self.recorded_at,
        }
