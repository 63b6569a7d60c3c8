"""What esk writes on its topics and into its stores, and how it is encoded: each record is a
frozen msgspec Struct whose declared fields are its JSON object, field for field, and its
decode checks the types those fields declare (a record that fails is a DecodeError).

- commands topic: key `<id>` (the aggregate id), value `CommandEnvelope`
- `<app>.<type>.events`: key `<id>`, value an event record, headers esk-*
- results topic: key `<id>` (the aggregate id), value `Outcome`
- changelog (and every store): `a/<type>/<id>` -> `StoredAggregate`, `c/<command_id>` -> `Outcome`
- the API's history index (a store of its own): `a/<type>/<id>/<version>` -> the event
  record as on its events topic

Commands, events and outcomes share the aggregate id as key, so the default partitioner
puts all three on the same partition number (the topics have equal partition counts): a
task's transaction touches one partition of each topic it writes, not most of them.
"""

from __future__ import annotations

import hashlib
import operator
import time
from enum import StrEnum
from typing import Annotated, Any, ClassVar, Self

import msgspec


class DecodeError(ValueError):
    """A record that is not what its topic promises; it goes to the DLQ."""


def now_ms() -> int:
    return int(time.time() * 1000)


def aggregate_key(aggregate_type: str, aggregate_id: str) -> bytes:
    return f"a/{aggregate_type}/{aggregate_id}".encode()


def command_key(command_id: str) -> bytes:
    return f"c/{command_id}".encode()


def history_prefix(aggregate_type: str, aggregate_id: str) -> bytes:
    """What every key of one aggregate's events in the API's history index starts with (ids
    hold no "/", so no other aggregate's keys start with it)."""
    return aggregate_key(aggregate_type, aggregate_id) + b"/"


MAX_VERSION = 2**63 - 1  # an aggregate's version is an int64, in records and in the HTTP API


def history_key(aggregate_type: str, aggregate_id: str, version: int) -> bytes:
    """An event in the API's history index: `a/<type>/<id>/` and the version as 8 big-endian
    bytes, so that an aggregate's events sit together and sort by version numerically (as
    digits, version 10 would sort before version 9)."""
    return history_prefix(aggregate_type, aggregate_id) + version.to_bytes(8, "big")


def prefix_end(prefix: bytes) -> bytes:
    """The first key after every key that starts with `prefix` (which does not end in 0xff)."""
    return prefix[:-1] + bytes([prefix[-1] + 1])


AGGREGATE_PREFIX = b"a/"
AGGREGATE_END = b"a0"  # the first key after every AGGREGATE_PREFIX key ("0" follows "/")
POSITION_PREFIX = b"p/"
EXPIRY_PREFIX = b"x/"
_EXPIRY_DIGITS = 15  # milliseconds, zero-padded so that keys sort by time


def position(topic: str, partition: int, offset: int) -> str:
    """A record's place, as esk names one everywhere: in logs and errors, a parked entry,
    the `after` token of a read."""
    return f"{topic}/{partition}/{offset}"


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


class _Record(msgspec.Struct, frozen=True):
    """A wire record: its JSON object holds the fields its class declares, in their order."""

    _decoder: ClassVar[msgspec.json.Decoder[Any]]

    def encode(self) -> bytes:
        return _ENCODER.encode(self)

    @classmethod
    def decode(cls, value: bytes | None) -> Self:
        if value is None:
            raise DecodeError("empty record")
        try:
            record: Self = cls._decoder.decode(value)
        except msgspec.ValidationError as error:  # a subclass of msgspec.DecodeError
            raise DecodeError(f"not a {cls.__name__}: {error}") from None
        except msgspec.DecodeError as error:
            raise DecodeError(f"not JSON: {error}") from None
        return record


# Encoded records stay alive for a while (a batch holds thousands until its commit); this
# encoder's bytes are the document's own size, not a working buffer's.
_ENCODER = msgspec.json.Encoder()

_Name = Annotated[str, msgspec.Meta(min_length=1)]


class CommandEnvelope(_Record, frozen=True, forbid_unknown_fields=True):
    command_id: _Name
    aggregate_type: _Name
    aggregate_id: _Name
    command: _Name
    payload: dict[str, Any]
    expected_version: int | None = None
    expect_new: bool = False
    correlation_id: str | None = None
    causation_id: str | None = None
    submitted_at: int = msgspec.field(default_factory=now_ms)

    @property
    def key(self) -> bytes:
        return self.aggregate_id.encode()


class Status(StrEnum):
    ACCEPTED = "accepted"
    REJECTED = "rejected"
    PRECONDITION_FAILED = "precondition_failed"


# The code of a command refused because its aggregate's stored state cannot be used by the
# current state model (its events do not fold into it): a fault of the service, not the caller.
STATE_UNUSABLE = "state_unusable"
# The codes of a command refused because the processor's code has no such aggregate type,
# or no such command of it (one queued before a release took it away): the API's own
# refusals of such a command carry them too.
UNKNOWN_AGGREGATE_TYPE = "unknown_aggregate_type"
UNKNOWN_COMMAND = "unknown_command"


_CANONICAL = msgspec.json.Encoder(order="deterministic")


def payload_digest(payload: dict[str, Any]) -> str:
    """A digest of a command's payload, the same for the same JSON value whatever the order
    of its keys: a retry under a command id must carry its first payload. Eight bytes tell
    a client's mistake, which is all it is for."""
    return hashlib.blake2b(_CANONICAL.encode(payload), digest_size=8).hexdigest()


class Outcome(_Record, frozen=True):
    command_id: str
    aggregate_type: str
    aggregate_id: str
    command: str
    status: Status
    version: int  # the aggregate's version after the command (current version if nothing happened)
    events: list[dict[str, Any]] = []
    code: str | None = None
    detail: str | None = None
    processed_at: int = msgspec.field(default_factory=now_ms)
    payload_digest: str | None = None  # payload_digest(the command's payload); None from releases before it

    @classmethod
    def of(
        cls,
        envelope: CommandEnvelope,
        status: Status,
        version: int,
        *,
        processed_at: int,
        events: list[dict[str, Any]] | None = None,
        code: str | None = None,
        detail: str | None = None,
    ) -> Outcome:
        """The outcome of `envelope`'s command, under the command's own identity."""
        return cls(
            envelope.command_id,
            envelope.aggregate_type,
            envelope.aggregate_id,
            envelope.command,
            status,
            version,
            [] if events is None else events,
            code,
            detail,
            processed_at,
            payload_digest(envelope.payload),
        )


class StoredAggregate(_Record, frozen=True):
    version: int
    state: dict[str, Any]
    updated_at: int  # event time (ms) of the last event
    expires_at: int | None = None  # set once the aggregate is final and its type has a retention
    # The state model's shape that wrote `state` (AggregateType.state_shape); None: written
    # before esk recorded shapes. Another shape than the type's current one is rebuilt.
    shape: str | None = None
    # Why the aggregate's events could not be folded into the current model (its commands
    # are refused with this reason until a start of fixed code rebuilds it).
    unusable: str | None = None


class EventRecord(_Record, frozen=True):
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

    PUBLIC: ClassVar[tuple[str, ...]] = ("event_id", "type", "version", "schema_version", "data", "recorded_at")

    def public(self) -> dict[str, Any]:
        """The event as the HTTP API shows it: the fields `PUBLIC` names."""
        return dict(zip(self.PUBLIC, _public_values(self), strict=True))

    def headers(self) -> list[tuple[str, bytes]]:
        return [
            ("esk-event-type", self.type.encode()),
            ("esk-schema-version", str(self.schema_version).encode()),
            ("esk-command-id", self.command_id.encode()),
            ("esk-correlation-id", self.correlation_id.encode()),
            ("esk-causation-id", self.causation_id.encode()),
        ]


_public_values = operator.attrgetter(*EventRecord.PUBLIC)

for _type in _Record.__subclasses__():
    # not in __init_subclass__: msgspec builds a decoder only for a finished class
    _type._decoder = msgspec.json.Decoder(_type)
