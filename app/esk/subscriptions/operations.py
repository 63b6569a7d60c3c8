"""What `esk subscriptions status|parked|retry|skip|reset` does to one subscription.

Retry and skip go through the same sinks as the subscriber, partition by partition: a
Reactor's partition producer is taken over (init_transactions with the partition's
transactional id), which fences the running member's producer, so what the retry sends
and what it marks retried commit together, and the member starts that partition again
from what committed; a DatabaseHandler's retry is one transaction of its database per
aggregate, serialized with the subscriber's own.

A reset rewinds the offsets and leaves a replay mark (handlers see `ctx.replaying` until
the subscription is back where it was). A DatabaseHandler's reset is one transaction with
its `on_reset` hook, and may run while subscribers do (their next commit finds the offset
moved and they start again from it); the Kafka kinds' offsets can only be moved while the
group has no member.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from ..domain.aggregate import AggregateType
from ..kafka.client_options import client_options
from ..kafka.groups import all_partitions, commit_offsets_of_empty_group, committed_offsets, group_members, partition_offsets
from ..kafka.stopping import stop_consumer
from ..settings import Settings
from .api import AnySubscription, DatabaseHandler
from .database import Transaction
from .database_sink import load_parked, read_offsets, rewind
from .parked_topic import parked_key, replay_key
from .parking import ParkedEvent, ParkStatus
from .routing import Router
from .sinks import Fenced, UnitLost
from .stores import DatabaseMissing, Stores, group_id
from .worker import resolve_parked

FENCED_ATTEMPTS = 5  # a member that starts its partition again meanwhile fences the tool in turn


class RefusedError(Exception):
    """An operation that cannot run now, with what to do about it."""


@dataclass(frozen=True)
class PartitionStatus:
    topic: str
    partition: int
    next_offset: int | None  # what the subscription committed (None: nothing yet)
    end: int  # the partition's last stable offset
    lag: int
    parked: int  # events parked now


@dataclass(frozen=True)
class SubscriptionStatus:
    name: str
    kind: str
    partitions: list[PartitionStatus]
    not_started: str | None = None  # why nothing is counted as handled: no database yet

    @property
    def lag(self) -> int:
        return sum(p.lag for p in self.partitions)

    @property
    def caught_up(self) -> bool:
        return self.lag == 0

    @property
    def parked(self) -> int:
        return sum(p.parked for p in self.partitions)


@dataclass
class RetryReport:
    handled: list[ParkedEvent] = field(default_factory=list)  # now retried (or skipped)
    still_parked: list[ParkedEvent] = field(default_factory=list)  # failed again, or behind one that did


class SubscriptionOperations:
    def __init__(self, settings: Settings, subscription: AnySubscription, registry: Mapping[str, AggregateType[Any]]) -> None:
        self.settings = settings
        self.subscription = subscription
        self.router = Router(subscription, registry, settings.app)

    @asynccontextmanager
    async def _stores(self, make_database: bool = False) -> AsyncIterator[Stores]:
        """The subscription's stores; a database handler's database only where its
        subscriber made one, unless `make_database` (a reset before its first run)."""
        stores = Stores(self.settings, self.subscription, self.router)
        # In the group's name but never in the group: it reads committed offsets, it does not join.
        consumer = AIOKafkaConsumer(**client_options(self.settings), group_id=stores.group_id, enable_auto_commit=False)
        await consumer.start()
        try:
            await stores.open(consumer, make_database=make_database)
            yield stores
        finally:
            await stores.close()
            await stop_consumer(consumer)

    async def committed(self) -> dict[TopicPartition, int]:
        if isinstance(self.subscription, DatabaseHandler):
            async with self._stores() as stores, _transaction(stores) as tx:
                return {tp: offsets[0] for tp, offsets in (await read_offsets(tx.esk, self.subscription.name)).items()}
        return await committed_offsets(self.settings, group_id(self.settings, self.subscription))

    async def status(self) -> SubscriptionStatus:
        tps = await all_partitions(self.settings, self.router.topics)
        # the committed offsets first: the ends read after them are at or past them, where
        # ends read first could be behind a member's later commit ("next 1185, end 1183")
        not_started = None
        try:
            committed = await self.committed()
        except DatabaseMissing as missing:  # nothing handled: the whole topics behind, none parked
            committed, not_started = {}, str(missing)
        beginning, end, _ = await partition_offsets(self.settings, tps)
        if not_started is None:
            async with self._stores() as stores:
                parked = {tp: sum(counts.values()) for tp, counts in (await stores.parked_counts(tps)).items()}
        else:
            parked = dict.fromkeys(tps, 0)
        partitions = [
            PartitionStatus(
                tp.topic, tp.partition, committed.get(tp), end[tp], max(0, end[tp] - committed.get(tp, beginning[tp])), parked[tp]
            )
            for tp in sorted(tps)
        ]
        return SubscriptionStatus(self.subscription.name, self.subscription.kind.value, partitions, not_started)

    async def parked(self, include_resolved: bool = False) -> list[ParkedEvent]:
        async with self._stores() as stores:
            return await _all_parked(stores, include_resolved)

    async def retry(self, aggregate_id: str | None, by: str) -> RetryReport:
        """Handle each parked aggregate's events again, in order, with today's code; the
        first that fails again stays parked, and the aggregate's later ones with it."""
        return await self._resolve(aggregate_id, by, ParkStatus.RETRIED)

    async def skip(self, aggregate_id: str | None, by: str) -> RetryReport:
        """Drop the parked events, keeping the record of who skipped them and when."""
        return await self._resolve(aggregate_id, by, ParkStatus.SKIPPED)

    async def _resolve(self, aggregate_id: str | None, by: str, status: ParkStatus) -> RetryReport:
        report = RetryReport()
        async with self._stores() as stores:
            parked = [p for p in await _all_parked(stores, False) if aggregate_id is None or p.aggregate_id == aggregate_id]
            partitions: dict[TopicPartition, set[str]] = {}
            for event in parked:
                partitions.setdefault(TopicPartition(event.topic, event.partition), set()).add(event.aggregate_id)
            for tp, aggregates in sorted(partitions.items()):
                for attempt in range(1, FENCED_ATTEMPTS + 1):
                    try:
                        await self._resolve_partition(stores, tp, sorted(aggregates), by, status, report)
                        break
                    except Fenced:
                        if attempt == FENCED_ATTEMPTS:
                            raise
        return report

    async def _resolve_partition(
        self, stores: Stores, tp: TopicPartition, aggregates: list[str], by: str, status: ParkStatus, report: RetryReport
    ) -> None:
        """Each aggregate's parked events in one unit of the partition's sink; what a unit
        committed goes into `report`."""
        sink = stores.sink(tp)
        await sink.open()  # a Reactor's: fences the member that has the partition
        try:
            for aggregate_id in aggregates:
                unit = await sink.begin()
                try:
                    parked = await unit.parked_to_resolve(aggregate_id)  # as of now, after the fencing
                    resolved, still_parked = await resolve_parked(unit, self.router, parked, status, by)
                except BaseException:
                    await unit.abort()
                    raise
                try:
                    await unit.commit(None)
                except UnitLost:  # an event handled again failed the second time: all stay as they were
                    report.still_parked.extend(parked)
                    continue
                report.handled.extend(resolved)
                report.still_parked.extend(still_parked)
        finally:
            await sink.close()

    async def reset(self, to: datetime | None, keep_data: bool = False, by: str = "esk") -> dict[TopicPartition, int]:
        """Rewind to the earliest offsets (`to` None) or to the first record at or after
        `to`; return the new offsets. A database handler's `on_reset` hook clears its tables
        in the rewind's transaction, for a replay from the earliest offsets; `keep_data`
        leaves them as they are instead, the replay taking events they hold again. Without
        it, a database handler is not rewound to a time (its `on_reset` would clear what a
        replay from there never writes again), nor at all without an `on_reset`. Events still
        parked past the new offsets are marked reset by `by`."""
        subscription = self.subscription
        if to is not None and to > datetime.now(UTC):
            # no record is at or after it: every partition would go to its end, skipping all
            raise RefusedError(
                f"subscription {subscription.name!r} cannot replay from {to.isoformat()}, a time still to come: "
                "give a time that has passed, or earliest"
            )
        if isinstance(subscription, DatabaseHandler) and not keep_data:
            if to is not None:
                raise RefusedError(
                    f"subscription {subscription.name!r} replays from {to.isoformat()} only the events since then, "
                    f"{'while its on_reset clears what a replay from the earliest writes' if subscription.on_reset else 'into tables that hold them'}: "
                    "reset it --to earliest, or replay from the time into its tables as they are with --keep-data "
                    "(right for upserts, wrong for counters and sums)"
                )
            if subscription.on_reset is None:
                raise RefusedError(
                    f"subscription {subscription.name!r} has no on_reset: its tables keep what they hold, and the replay "
                    "applies each event again (right for upserts, wrong for counters and sums): give it an on_reset that "
                    "clears what the replay writes again, or replay with --keep-data"
                )
        tps = await all_partitions(self.settings, self.router.topics)
        at_ms = None if to is None else int(to.timestamp() * 1000)
        beginning, _, at = await partition_offsets(self.settings, tps, at_ms)
        offsets = beginning if to is None else at
        if isinstance(self.subscription, DatabaseHandler):
            await self._reset_database(offsets, not keep_data, by)
        else:
            await self._reset_group(offsets, by)
        return offsets

    async def _reset_database(self, offsets: dict[TopicPartition, int], clear: bool, by: str) -> None:
        assert isinstance(self.subscription, DatabaseHandler)
        # before its first run too: it starts from there (product.md)
        async with self._stores(make_database=True) as stores, _transaction(stores) as tx:
            if clear and self.subscription.on_reset is not None:
                await self.subscription.on_reset(tx.sql)
            await rewind(tx.esk, self.subscription.name, offsets, by)

    async def _reset_group(self, offsets: dict[TopicPartition, int], by: str) -> None:
        group = group_id(self.settings, self.subscription)
        members = await group_members(self.settings, group)
        if members:
            raise RefusedError(
                f"subscription {self.subscription.name!r} has {len(members)} running member(s) ({', '.join(members)}): "
                "stop its `esk subscriber` processes first; its offsets are in Kafka and move only while nobody reads them"
            )
        before = await committed_offsets(self.settings, group)
        async with self._stores() as stores:
            assert stores.parked_topic is not None
            topic = stores.parked_topic
            marks = {}
            for tp in offsets:
                state = await topic.refresh(topic.partition_of(tp.partition))
                marks[tp] = max(before.get(tp, 0), state.replay_until.get((tp.topic, tp.partition), 0))
            await commit_offsets_of_empty_group(self.settings, group, offsets)
            # After the offsets: a crash between the two leaves events parked past the new
            # offsets, which the member marks as it opens the partition (worker._mark_ahead),
            # never events marked reset without their replay.
            producer = AIOKafkaProducer(**client_options(self.settings), acks="all", enable_idempotence=True)
            await producer.start()
            try:
                for tp, offset in offsets.items():
                    partition = topic.partition_of(tp.partition)
                    await producer.send_and_wait(topic.topic, str(marks[tp]).encode(), key=replay_key(tp.topic, tp.partition), partition=partition)
                    state = await topic.refresh(partition)
                    for event in state.still_parked(tp.topic, tp.partition):
                        if event.offset >= offset:
                            reset = event.resolved(ParkStatus.RESET, by)
                            await producer.send_and_wait(topic.topic, reset.encode(), key=parked_key(reset), partition=partition)
            finally:
                await producer.stop()


@asynccontextmanager
async def _transaction(stores: Stores) -> AsyncIterator[Transaction]:
    assert stores.database is not None
    async with stores.database.transaction() as tx:
        yield tx


async def _all_parked(stores: Stores, include_resolved: bool) -> list[ParkedEvent]:
    if stores.database is not None:
        async with stores.database.transaction() as tx:
            return await load_parked(tx.esk, stores.subscription.name, None if include_resolved else ParkStatus.PARKED)
    topic = stores.parked_topic
    assert topic is not None
    found: list[ParkedEvent] = []
    for partition in range(topic.partition_count):
        state = await topic.refresh(partition)
        found.extend(e for e in state.parked.values() if include_resolved or e.status is ParkStatus.PARKED)
    return sorted(found, key=lambda e: (e.topic, e.partition, e.offset))

