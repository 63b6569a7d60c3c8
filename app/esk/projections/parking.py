"""Parked aggregates of a read model: an event that makes the read model's batch fail (a
payload its code cannot take: a cast that ANSI SQL refuses, a division by zero, a UDF that
raises) is found, and its aggregate held back from that event on, so that every other
aggregate goes on. Without it, one such event stops the read model for good: its batch
fails each time the query starts again.

An aggregate's events keep their order: once one is held back, so are its later ones, in
this batch and the next. Parking is per table generation: after a fix, a rebuild (a raised
`ReadModel.version`, or `esk project run NAME --rebuild`) builds a new generation from the
earliest offsets, with nothing parked, and the parked aggregates' events go in again.

Kept in the generation's checkpoint folder, a file per batch that parked, written before
the batch's write: a batch that Spark runs again after a crash holds back the same
aggregates, and a generation started over (checkpoint and all) starts with none.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from ..protocol import now_ms

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame

# Parked aggregates at most, per generation: past them, what fails is the read model, not an
# event, and its batch fails as it would without parking. Few: a read model that fails on
# every event of a kind, in batches of one or two events (a continuous run's), parks each
# batch's aggregate until then, events that its fix and a rebuild take in again.
PARKED_MAX = 20
# Aggregates one batch parks at most: past them, its failure is told instead (a read model
# that fails on every event of a kind, say, rather than on one).
PARKED_PER_BATCH_MAX = 5
# Aggregates a generation parks at most for one failure (the same Spark error on the same
# event type), across batches: a poison event is a one-off, and the same failure again and
# again is the read model's, on every event of a kind, however small its batches.
SAME_FAILURE_MAX = 3


class ParkedAggregate(msgspec.Struct, frozen=True):
    """An aggregate held back from a read model, from the event at (partition, offset) on."""

    aggregate_type: str
    aggregate_id: str
    partition: int
    offset: int
    event_type: str | None  # of the event that failed the batch (None: its envelope had none)
    reason: str
    batch_id: int
    parked_at: int = msgspec.field(default_factory=now_ms)
    failure: str = ""  # Spark's error, as a kind (its class and condition): what SAME_FAILURE_MAX counts


FOLDER = "esk-parked"


class ParkedAggregates:
    """The aggregates a generation holds back, in the folder `checkpoint/esk-parked`."""

    def __init__(self, checkpoint: Path) -> None:
        self.folder = checkpoint / FOLDER

    def load(self) -> list[ParkedAggregate]:
        if not self.folder.is_dir():
            return []
        parked: list[ParkedAggregate] = []
        for file in sorted((f for f in self.folder.glob("*.json") if f.stem.isdigit()), key=lambda f: int(f.stem)):
            parked.extend(msgspec.json.decode(file.read_bytes(), type=list[ParkedAggregate]))
        return parked

    def add(self, batch_id: int, parked: Sequence[ParkedAggregate]) -> None:
        """`parked`, by the batch that found them: written whole or not at all, and written
        again as the same when the batch runs again."""
        self.folder.mkdir(parents=True, exist_ok=True)
        file = self.folder / f"{batch_id}.json"
        written = file.with_suffix(".tmp")
        with written.open("wb") as out:
            out.write(msgspec.json.encode(list(parked)))
            out.flush()
            os.fsync(out.fileno())
        written.replace(file)
        folder = os.open(self.folder, os.O_RDONLY)
        try:  # the rename itself, durable before the batch's write
            os.fsync(folder)
        finally:
            os.close(folder)


@dataclass(frozen=True)
class Span:
    """The offsets of one Kafka partition's events in a batch."""

    aggregate_type: str | None  # whose topic (None: records that do not decode)
    partition: int
    first: int
    last: int


@dataclass(frozen=True)
class Failure:
    """Why a part of a batch fails (Spark's error, in a line), and the failure's kind (its
    class and condition): a batch may fail in more than one way, an event of each."""

    reason: str
    kind: str


@dataclass(frozen=True)
class Prefix:
    """A batch's events up to and including `offset` of `spans[index]`: every event of
    the spans before it, and of that one up to `offset`."""

    spans: tuple[Span, ...]
    index: int
    offset: int


def first_failing(spans: Sequence[Span], fails: Callable[[Prefix], bool]) -> Prefix | None:
    """The shortest prefix of a batch (its partitions in the order of `spans`, each in its
    offsets' order) that `fails`, None when the whole batch does not: its last event is the
    one that makes the batch fail. Found by bisection, first of the spans, then within
    one, for an event that fails whatever follows it (a prefix keeps each aggregate's
    events in order, as an aggregate's events are all in one partition)."""
    ordered = tuple(spans)
    if not ordered or not fails(Prefix(ordered, len(ordered) - 1, ordered[-1].last)):
        return None
    low, high = 0, len(ordered) - 1  # the first span whose whole prefix fails
    while low < high:
        middle = (low + high) // 2
        if fails(Prefix(ordered, middle, ordered[middle].last)):
            high = middle
        else:
            low = middle + 1
    span = ordered[low]
    first, last = span.first, span.last  # the first offset in it whose prefix fails
    while first < last:
        middle = (first + last) // 2
        if fails(Prefix(ordered, low, middle)):
            last = middle
        else:
            first = middle + 1
    return Prefix(ordered, low, first)


# -- over a batch's events (Spark) -----------------------------------------------------------


def held_back(parked: Sequence[ParkedAggregate]) -> Column:
    """True on the events `parked` holds back: each aggregate's from its parked event on."""
    from pyspark.sql import functions as F

    # Null-safe: a record that does not decode has no type nor id, and a null here would
    # make `~held_back` null too, and drop it unseen.
    condition = F.lit(False)
    for p in parked:
        earlier = (F.col("kafka_partition") == p.partition) & (F.col("kafka_offset") < p.offset)
        aggregate = F.col("aggregate_type").eqNullSafe(p.aggregate_type) & F.col("aggregate_id").eqNullSafe(p.aggregate_id)
        condition = condition | (aggregate & ~earlier)
    return condition


def _within(prefix: Prefix) -> Column:
    from pyspark.sql import functions as F

    def span_of(span: Span) -> Column:
        return F.col("aggregate_type").eqNullSafe(F.lit(span.aggregate_type)) & (F.col("kafka_partition") == span.partition)

    condition = span_of(prefix.spans[prefix.index]) & (F.col("kafka_offset") <= prefix.offset)
    for span in prefix.spans[: prefix.index]:
        condition = condition | span_of(span)
    return condition


def find_parked(
    events: DataFrame, batch_id: int, fails: Callable[[DataFrame], Failure | None], parked: Sequence[ParkedAggregate]
) -> list[ParkedAggregate]:
    """The aggregates to hold back so that the read model's batch (`events`, decoded) no
    longer `fails` (which tells why, and the failure's kind, or None), found one at a time
    (first_failing). None when the read model itself fails, not an event: the batch as a
    whole does not fail (what failed is its write), or fails over no events too, or would
    hold back every aggregate it has (two or more), or more than a batch
    (PARKED_PER_BATCH_MAX) or a generation (`parked` there already: PARKED_MAX, and
    SAME_FAILURE_MAX for one event type's failure) may park."""
    from pyspark.sql import functions as F

    spans = tuple(
        Span(row["aggregate_type"], row["kafka_partition"], row["first"], row["last"])
        for row in events.groupBy("aggregate_type", "kafka_partition")
        .agg(F.min("kafka_offset").alias("first"), F.max("kafka_offset").alias("last"))
        .orderBy("aggregate_type", "kafka_partition")
        .collect()
    )
    found: list[ParkedAggregate] = []
    while True:
        remaining = events.filter(~held_back(found)) if found else events
        reasons: dict[Prefix, Failure] = {}

        def prefix_fails(prefix: Prefix, remaining: DataFrame = remaining, reasons: dict[Prefix, Failure] = reasons) -> bool:
            failed = fails(remaining.filter(_within(prefix)))
            if failed is not None:
                reasons[prefix] = failed
            return failed is not None

        failing = first_failing(spans, prefix_fails)
        if failing is None:
            every = len(found) > 1 and events.select("aggregate_type", "aggregate_id").distinct().count() == len(found)
            return [] if every else found
        if failing.index == 0 and failing.offset == spans[0].first and fails(remaining.limit(0)) is not None:
            return []  # it fails over no events too: its code, not an event
        if len(found) >= min(PARKED_PER_BATCH_MAX, PARKED_MAX - len(parked)):
            return []
        span = failing.spans[failing.index]
        event = (
            remaining.filter(F.col("aggregate_type").eqNullSafe(F.lit(span.aggregate_type)) & (F.col("kafka_partition") == span.partition)
                             & (F.col("kafka_offset") == failing.offset))
            .select("aggregate_id", "type")
            .first()
        )
        if event is None or span.aggregate_type is None or event["aggregate_id"] is None:
            return []  # no event there (what fails is not an event's), or one that does not decode
        failure = reasons[failing].kind
        same = [p for p in (*parked, *found) if (p.aggregate_type, p.event_type, p.failure) == (span.aggregate_type, event["type"], failure)]
        if len(same) >= SAME_FAILURE_MAX:
            return []
        found.append(ParkedAggregate(span.aggregate_type, event["aggregate_id"], span.partition, failing.offset, event["type"],
                                     reasons[failing].reason, batch_id, failure=failure))
