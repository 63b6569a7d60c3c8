"""Parked events: what a subscription could not handle, kept with the reason until someone
retries or skips them.

A parked event holds the record as it was read (key, value, headers), so a retry decodes it
again with the code and upcasters of the day. While an aggregate has a parked event, its
later events are parked behind it, in order; every other aggregate goes on.

A DatabaseHandler keeps them in its database (`esk_parked`, database_sink.py), the Kafka
kinds on a compacted topic of their own (parked_topic.py).
"""

from __future__ import annotations

from enum import StrEnum
from typing import TypeVar

import msgspec
from aiokafka.structs import ConsumerRecord

from ..domain.aggregate import NewerSchemaVersion
from ..protocol import now_ms, position

T = TypeVar("T")


UNDECODABLE = "undecodable: "  # how the reason of an event parked because it does not decode begins
# ... and of one whose schema version is newer than the code's.
NEWER_VERSION = f"{UNDECODABLE}{NewerSchemaVersion.__name__}"
WAITS_BEHIND = "waits behind an earlier parked event of "  # ... and of one parked only for that
# Why an event is parked, as esk_subscription_events_total's `result` and
# esk_subscription_parked's count it (parked_result).
PARKED_RESULTS = ("parked", "parked_newer_version", "parked_behind")


def parked_result(reason: str) -> str:
    """The `result` an event parked for `reason` counts under. Only `parked` needs someone
    (its handler failed every attempt, or it does not decode): the others wait for the
    event before them, or for this subscriber to run the code that wrote them, as a rolling
    deployment does for a while."""
    if reason.startswith(NEWER_VERSION):
        return "parked_newer_version"
    if reason.startswith(WAITS_BEHIND):
        return "parked_behind"
    return "parked"


class ParkStatus(StrEnum):
    PARKED = "parked"
    RETRIED = "retried"  # handled by `esk subscriptions retry`, or by esk as it opened the partition (resolved_by says why)
    SKIPPED = "skipped"  # dropped by `esk subscriptions skip`
    RESET = "reset"  # still parked when the offset went back before it (`esk subscriptions reset`): its replay meets it again


class Resolution(msgspec.Struct, frozen=True):
    """How an event parked at the same position before was resolved: a reset's replay may
    park it again, and the new entry keeps who retried or skipped it then."""

    status: ParkStatus
    by: str | None
    at: int | None
    reason: str  # what it had been parked for


class ParkedEvent(msgspec.Struct, frozen=True):
    subscription: str
    topic: str
    partition: int
    offset: int
    aggregate_id: str  # the record's key: what later events wait behind
    event_type: str | None  # from the record's header, when it had one
    reason: str
    attempts: int
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes]]
    parked_at: int = msgspec.field(default_factory=now_ms)
    status: ParkStatus = ParkStatus.PARKED
    resolved_by: str | None = None
    resolved_at: int | None = None
    earlier: tuple[Resolution, ...] = ()  # oldest first

    @classmethod
    def of(
        cls, subscription: str, record: ConsumerRecord[bytes, bytes], reason: str, attempts: int, event_type: str | None = None
    ) -> ParkedEvent:
        """`event_type`: what the record is, where its headers do not say (an outcome)."""
        return cls(
            subscription,
            record.topic,
            record.partition,
            record.offset,
            aggregate_key(record),
            header(record, "esk-event-type") or event_type,
            reason,
            attempts,
            record.key,
            record.value,
            [(name, bytes(value)) for name, value in record.headers],
        )

    @property
    def position(self) -> str:
        return position(self.topic, self.partition, self.offset)

    def record(self) -> ConsumerRecord[bytes, bytes]:
        """The record as it was read, to be handled again."""
        return ConsumerRecord(
            topic=self.topic, partition=self.partition, offset=self.offset, timestamp=self.parked_at, timestamp_type=0,
            key=self.key, value=self.value, checksum=None, serialized_key_size=-1, serialized_value_size=-1,
            headers=list(self.headers),
        )

    def resolved(self, status: ParkStatus, by: str) -> ParkedEvent:
        return msgspec.structs.replace(self, status=status, resolved_by=by, resolved_at=now_ms())

    def after(self, before: ParkedEvent | None) -> ParkedEvent:
        """This event, parked where `before` (the entry at its position, if any) was: what
        resolved `before` is kept, and what resolved the ones before it."""
        if before is None:
            return self
        earlier = before.earlier
        if before.status is not ParkStatus.PARKED:
            earlier += (Resolution(before.status, before.resolved_by, before.resolved_at, before.reason),)
        return msgspec.structs.replace(self, earlier=earlier)

    def failed_again(self, reason: str, attempts: int) -> ParkedEvent:
        return msgspec.structs.replace(self, reason=reason, attempts=self.attempts + attempts)

    def encode(self) -> bytes:
        return _ENCODER.encode(self)


    @classmethod
    def decode(cls, value: bytes) -> ParkedEvent:
        return decoded(_DECODER, value)


class WrittenByNewerRelease(ValueError):
    """A parked entry of a status this release does not know: a later release wrote it,
    and reading it as any status this one knows could handle an event twice or never."""


_AN_UNKNOWN_STATUS = "Invalid enum value"


def _newer_status(told: str) -> WrittenByNewerRelease:
    return WrittenByNewerRelease(
        f"a parked entry has a status this release does not know ({told}): a later esk wrote it; "
        "run that release on every member of the subscription"
    )


def decoded(decoder: msgspec.json.Decoder[T], value: bytes) -> T:
    """`value` decoded; an entry of a status this release does not know is told as such
    (the only enum of a parked entry is its status, and its earlier resolutions')."""
    try:
        return decoder.decode(value)
    except msgspec.ValidationError as error:
        if _AN_UNKNOWN_STATUS in str(error):
            raise _newer_status(str(error)) from None
        raise


def park_status(value: str) -> ParkStatus:
    """A status as stored (a database handler's column)."""
    try:
        return ParkStatus(value)
    except ValueError:
        raise _newer_status(repr(value)) from None


_ENCODER = msgspec.json.Encoder()
_DECODER = msgspec.json.Decoder(ParkedEvent)


def aggregate_key(record: ConsumerRecord[bytes, bytes]) -> str:
    """What a record's later records of the same aggregate wait behind: its key, the
    aggregate id on every topic a subscription reads."""
    return record.key.decode(errors="replace") if record.key is not None else ""


def header(record: ConsumerRecord[bytes, bytes], name: str) -> str | None:
    for key, value in record.headers:
        if key == name:
            return bytes(value).decode(errors="replace")
    return None
