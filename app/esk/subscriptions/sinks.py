"""Where a subscription's effects, offsets and parked events go: one sink per input partition.

Each kind has its own (kafka_sinks.py, database_sink.py); the PartitionWorker drives all of
them alike: `open` (fence whoever had the partition, say where to start), then units of
work, each ending in `commit(next_offset)`, which makes the handled records' effects, the
parked ones and the offset visible together, or none of them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from .parking import ParkedEvent
from .routing import Delivery


class Fenced(Exception):
    """The partition's offset moved under this member: another member has the partition
    now, or a reset rewound it. Nothing of the unit was committed."""


class UnitLost(Exception):
    """A unit that undid its latest events after one failed could not write them again (its
    transaction is gone, or a handler failed the second time): it commits nothing."""


@dataclass(frozen=True)
class StartingPoint:
    next_offset: int | None  # None: nothing committed yet, start from the beginning
    replay_until: int = 0  # events below this offset are handled again (a reset's replay)
    # The aggregates with parked events, each with the reason its first one was parked for.
    parked: Mapping[str, str] = field(default_factory=dict)
    # The offsets of events still parked at or past next_offset, in order (see `of`).
    parked_ahead: tuple[int, ...] = ()

    @classmethod
    def of(cls, next_offset: int | None, replay_until: int, parked: Iterable[tuple[str, int, str]]) -> StartingPoint:
        """From the (aggregate id, offset, reason) of each event still parked."""
        first: dict[str, tuple[int, str]] = {}
        ahead: list[int] = []
        for aggregate_id, offset, reason in parked:
            if is_ahead(offset, next_offset):
                ahead.append(offset)
            elif aggregate_id not in first or offset < first[aggregate_id][0]:
                first[aggregate_id] = (offset, reason)
        return cls(next_offset, replay_until, {aggregate_id: reason for aggregate_id, (_, reason) in first.items()}, tuple(sorted(ahead)))


def is_ahead(offset: int, next_offset: int | None) -> bool:
    """Whether an event parked at `offset` is at or past the partition's `next_offset`
    (None: nothing committed). Such an event was parked by a pass the offset has since moved
    back before: a reset that stopped between the offsets and its marks, an at-least-once
    unit whose offset commit never happened. The pass from the offset meets it again: it
    holds its aggregate back from nothing before it."""
    return offset >= (next_offset or 0)


class Unit(ABC):
    """One transaction's worth of a partition's work. After `commit` (which raises Fenced
    when superseded) or `abort`, it is over; `abort` of a unit that is over does nothing."""

    @abstractmethod
    async def apply(self, delivery: Delivery, replaying: bool) -> None:
        """Run the delivery's handler into this unit. If it raises, whatever it did is
        undone (alone: what the unit held before stays) and the error goes up."""

    @abstractmethod
    async def park(self, event: ParkedEvent) -> None:
        """Keep `event` (a parked one, or one whose status changed: the same position is
        the same entry)."""

    @abstractmethod
    async def parked_of(self, aggregate_id: str) -> list[ParkedEvent]:
        """This partition's events of the aggregate that are parked now, in order, as the
        store has them (a retry or skip from the command line may have resolved some since
        the partition started)."""

    @abstractmethod
    async def entry_at(self, offset: int) -> ParkedEvent | None:
        """The entry this partition's store holds for the event at `offset`, whatever its
        status (None: it was never parked)."""

    async def parked_to_resolve(self, aggregate_id: str) -> list[ParkedEvent]:
        """`parked_of`, for a unit that will resolve them: no other unit resolves them until
        this one ends. The Kafka kinds' open fenced whoever else could; a database's
        transactions need a lock."""
        return await self.parked_of(aggregate_id)

    @abstractmethod
    async def commit(self, next_offset: int | None) -> None:
        """Make the unit's effects visible, with the offset moved to `next_offset` (None:
        the offset stays where it is, for retries and skips from the command line)."""

    @abstractmethod
    async def abort(self) -> None: ...


class PartitionSink(ABC):
    # Whether what a unit resolves of an aggregate's parked events is resolved by it alone
    # while the partition is this member's (a lock, or an operation that fences the member):
    # the worker then takes up events parked behind nothing as it meets them, not only as it
    # opens the partition.
    resolves_alone = True

    @abstractmethod
    async def open(self) -> StartingPoint:
        """Take the partition: from here on, a previous owner can commit nothing more."""

    @abstractmethod
    async def begin(self) -> Unit: ...

    async def verify(self) -> None:
        """Raise Fenced if the partition's offset moved under this member while it had
        nothing to commit (a database handler's offsets may be reset while it runs)."""
        return  # the Kafka kinds' offsets move only while their group has no member

    @abstractmethod
    async def close(self) -> None: ...
