"""A subscription's handlers against a list of events, with no Kafka: for a user's own tests.

    run = await run_subscription(payments, [("o1", Placed(customer_id="c1", lines=[...], pay_from="a1"))])
    assert [s.command for s in run.commands] == [Withdraw(amount=500)]
    run = await run_subscription(payments, [run.commands[0].rejected("insufficient_funds")])
    assert [s.command for s in run.commands] == [Cancel()]

The events go through what `esk subscriber` runs (routing by type, decoding, the worker with
its retries and parking); only Kafka is left out: a reactor's commands are collected, a
DatabaseHandler writes to a real database (an in-memory SQLite unless given one), whose
rows the test reads with `run.query`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiokafka import TopicPartition
from aiokafka.structs import ConsumerRecord

from ..domain.aggregate import AggregateType, Command, Event
from ..protocol import EventRecord, Outcome, Status
from .api import AnySubscription, DatabaseHandler, Kind, Retries
from .database import Database, DatabaseConfig, Row, SQLite
from .database_sink import DatabaseSink, load_parked, prepare
from .parking import ParkedEvent
from .routing import Delivery, Router, call_handler, reactor_commands
from .sinks import PartitionSink, StartingPoint, Unit
from .worker import FailedWithItsUnit, PartitionWorker

APP = "test"  # the application name the records seem to come from
_TOPIC_PARTITION = 0


@dataclass(frozen=True)
class SentCommand:
    """A command a reactor sent; `accepted()` and `rejected(code)` make its outcome, to run the
    reactor's outcome handlers with."""

    command_id: str
    aggregate_type: AggregateType[Any]
    aggregate_id: str
    command: Command
    expected_version: int | None = None

    def accepted(self, version: int = 1) -> Reply:
        return Reply(self, Status.ACCEPTED, version)

    def rejected(self, code: str, detail: str = "", version: int = 0) -> Reply:
        return Reply(self, Status.REJECTED, version, code, detail or code)


@dataclass(frozen=True)
class Reply:
    sent: SentCommand
    status: Status
    version: int
    code: str | None = None
    detail: str | None = None

    def outcome(self) -> Outcome:
        sent = self.sent
        name = next(n for n, t in sent.aggregate_type.commands.items() if t is type(sent.command))
        return Outcome(sent.command_id, sent.aggregate_type.name, sent.aggregate_id, name, self.status, self.version, [], self.code, self.detail)


Given = tuple[str, Event] | Reply  # (aggregate id, event), or the outcome of a command sent before


@dataclass
class SubscriptionRun:
    commands: list[SentCommand] = field(default_factory=list)
    parked: list[ParkedEvent] = field(default_factory=list)
    database: Database | None = None

    async def query(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        """Rows of a DatabaseHandler's database, after the run."""
        if self.database is None:
            raise RuntimeError("only a DatabaseHandler's run has a database")
        async with self.database.transaction() as tx:
            return await tx.sql.fetchall(sql, params)

    async def close(self) -> None:
        if self.database is not None:
            await self.database.close()


async def run_subscription(
    subscription: AnySubscription,
    given: Sequence[Given],
    *,
    database: DatabaseConfig | None = None,
    retries: Retries | None = None,
) -> SubscriptionRun:
    """Handle `given` in order, as the subscriber would: each topic's records by the worker
    of its partition, a run of consecutive records of one topic in one unit. `database`: a
    DatabaseHandler's (default: an in-memory SQLite; never the one it declares). `retries`:
    instead of the subscription's (`Retries(attempts=1)` parks a failing event at once)."""
    registry = {a.name: a for a in (*subscription.reads, *(g.sent.aggregate_type for g in given if isinstance(g, Reply)))}
    router = Router(subscription, registry, APP)
    run = SubscriptionRun()
    if isinstance(subscription, DatabaseHandler):
        run.database = (database or SQLite(":memory:")).connect(Path(":memory:"))
        await prepare(run.database, subscription)
    workers: dict[str, PartitionWorker] = {}
    suspects: dict[str, dict[int, Exception]] = {}

    async def start(topic: str) -> PartitionWorker:
        sink: PartitionSink
        if isinstance(subscription, DatabaseHandler):
            assert run.database is not None
            sink = DatabaseSink(run.database, subscription, TopicPartition(topic, _TOPIC_PARTITION))
        else:
            sink = _MemorySink(subscription, run)
        worker = PartitionWorker(subscription, router, sink, retries, suspects=suspects.setdefault(topic, {}))
        await worker.open()
        return worker

    for chunk in _runs_of_one_topic(_records(subscription, router, given)):
        topic = chunk[0].topic
        if topic not in workers:
            workers[topic] = await start(topic)
        while True:
            try:
                await workers[topic].handle(chunk, chunk[-1].offset + 1)
                break
            except FailedWithItsUnit as failed:  # as the subscriber does: the partition starts again
                suspects[topic][failed.offset] = failed.error
                workers[topic] = await start(topic)
    if run.database is not None:
        async with run.database.transaction() as tx:
            run.parked = await load_parked(tx.esk, subscription.name)
    return run


def _runs_of_one_topic(records: list[ConsumerRecord[bytes, bytes]]) -> list[list[ConsumerRecord[bytes, bytes]]]:
    runs: list[list[ConsumerRecord[bytes, bytes]]] = []
    for record in records:
        if runs and runs[-1][0].topic == record.topic:
            runs[-1].append(record)
        else:
            runs.append([record])
    return runs


def _records(subscription: AnySubscription, router: Router, given: Sequence[Given]) -> list[ConsumerRecord[bytes, bytes]]:
    versions: dict[tuple[str, str], int] = {}
    records = []
    for offset, item in enumerate(given):
        if isinstance(item, Reply):
            assert router.results_topic is not None, f"{subscription.name} handles no outcome"
            outcome = item.outcome()
            records.append(_record(router.results_topic, offset, outcome.aggregate_id, outcome.encode(), []))
            continue
        aggregate_id, event = item
        aggregate = subscription.aggregate_of(type(event))
        version = versions[aggregate.name, aggregate_id] = versions.get((aggregate.name, aggregate_id), 0) + 1
        event_id = f"{aggregate.name}/{aggregate_id}/{version}"
        record = EventRecord(
            event_id, aggregate.name, aggregate_id, version, event.type_name(), event.schema_version,
            event.model_dump(mode="json"), f"test-command-{offset}", f"test-command-{offset}", f"test-command-{offset}", 0,
        )
        records.append(_record(f"{APP}.{aggregate.name}.events", offset, aggregate_id, record.encode(), record.headers()))
    return records


def _record(topic: str, offset: int, key: str, value: bytes, headers: list[tuple[str, bytes]]) -> ConsumerRecord[bytes, bytes]:
    return ConsumerRecord(
        topic=topic, partition=_TOPIC_PARTITION, offset=offset, timestamp=0, timestamp_type=0, key=key.encode(),
        value=value, checksum=None, serialized_key_size=-1, serialized_value_size=-1, headers=headers,
    )


class _MemorySink(PartitionSink):
    """A Reactor's or SideEffectHandler's partition with what would go to Kafka kept in `run`."""

    def __init__(self, subscription: AnySubscription, run: SubscriptionRun) -> None:
        self.subscription = subscription
        self.run = run

    async def open(self) -> StartingPoint:
        return StartingPoint(None)

    async def begin(self) -> Unit:
        return _MemoryUnit(self)

    async def close(self) -> None:
        pass


class _MemoryUnit(Unit):
    def __init__(self, sink: _MemorySink) -> None:
        self.sink = sink
        self.commands: list[SentCommand] = []
        self.parked: list[ParkedEvent] = []

    async def apply(self, delivery: Delivery, replaying: bool) -> None:
        name = self.sink.subscription.name
        if self.sink.subscription.kind is Kind.REACTOR:
            for command_id, send in await reactor_commands(name, delivery, replaying):
                # as the processor reads it: what the command's model makes of its JSON
                command = send.aggregate_type.parse_command(send.command_name, send.command.model_dump(mode="json"))
                self.commands.append(SentCommand(command_id, send.aggregate_type, send.aggregate_id, command, send.expected_version))
        else:
            await call_handler(delivery, name, replaying)

    async def park(self, event: ParkedEvent) -> None:
        self.parked.append(event)

    async def parked_of(self, aggregate_id: str) -> list[ParkedEvent]:
        return [p for p in self.sink.run.parked if p.aggregate_id == aggregate_id]

    async def entry_at(self, offset: int) -> ParkedEvent | None:
        return None  # a run's events are each read once

    async def commit(self, next_offset: int | None) -> None:
        self.sink.run.commands.extend(self.commands)
        self.sink.run.parked.extend(self.parked)
        self._clear()

    async def abort(self) -> None:
        self._clear()

    def _clear(self) -> None:
        self.commands, self.parked = [], []
