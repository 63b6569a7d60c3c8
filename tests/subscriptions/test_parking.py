"""A handler that raises for one aggregate, against the real broker, for each kind (a
database handler on SQLite and on PostgreSQL): that aggregate's events are parked in order
while every other aggregate's keep flowing; after a fix, `retry` applies them in order, and
the aggregate flows again. A handler retried for longer than max.poll.interval.ms holds
back its own partition only."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from domain.orders import LineAdded, Placed, orders
from esk import Context, DatabaseContext, DatabaseHandler, PostgreSQL, Reactor, Retries, SideEffectHandler
from esk.kafka.groups import commit_offsets_of_empty_group, committed_offsets
from esk.kafka.partitioner import partition_for
from esk.runtime import told_fences_quiet
from esk.settings import Settings
from esk.subscriptions.api import AnySubscription
from esk.subscriptions.operations import SubscriptionOperations
from esk.subscriptions.stores import group_id
from esk.subscriptions.worker import PASSED_AGAIN
from tests.subscriptions.running import subscriber, subscriber_settings
from tests.system import System, system, wait_for

pytestmark = pytest.mark.kafka

FAST = Retries(attempts=2, first_delay_s=0.05)


class Recorder:
    """A subscription of one kind whose handler records (order, version) and raises for the
    order named `broken` while it is set."""

    def __init__(self, kind: str, postgres_dsn: str | None = None) -> None:
        self.kind = kind
        self.postgres_dsn = postgres_dsn
        self.broken: str | None = "bad"
        self.memory: list[tuple[str, int]] = []
        self.subscription = self._subscription()

    def _subscription(self) -> AnySubscription:
        name = f"recorder-{self.kind}"
        if self.kind in ("database", "postgres"):
            sub: AnySubscription = DatabaseHandler(
                name,
                reads=[orders],
                retries=FAST,
                database=PostgreSQL(self.postgres_dsn) if self.postgres_dsn else None,
                schema=["CREATE TABLE IF NOT EXISTS applied (n SERIAL, order_id TEXT, version INTEGER)" if self.postgres_dsn
                        else "CREATE TABLE IF NOT EXISTS applied (n INTEGER PRIMARY KEY, order_id TEXT, version INTEGER)"],
            )
            insert = "INSERT INTO applied (order_id, version) VALUES " + ("(%s, %s)" if self.postgres_dsn else "(?, ?)")

            async def record(event: Any, ctx: DatabaseContext) -> None:
                self._check(ctx)
                await ctx.db.execute(insert, (ctx.aggregate_id, ctx.version))

            handler: Callable[[Any, Any], Awaitable[Any]] = record
        else:
            sub = (Reactor if self.kind == "reactor" else SideEffectHandler)(name, reads=[orders], retries=FAST)

            async def remember(event: Any, ctx: Context) -> list[Any] | None:
                self._check(ctx)
                self.memory.append((ctx.aggregate_id, ctx.version))
                return [] if self.kind == "reactor" else None

            handler = remember
        sub.on(Placed)(handler)
        sub.on(LineAdded)(handler)
        return sub

    def _check(self, ctx: Context) -> None:
        if ctx.aggregate_id == self.broken:
            raise RuntimeError(f"cannot take {ctx.aggregate_id} yet")

    def applied(self, settings: Settings) -> list[tuple[str, int]]:
        """What was applied, in order; the in-memory kinds' once each (a partition started
        again after the retry fenced it handles its last batch again: their memory is no
        transaction)."""
        select = "SELECT order_id, version FROM applied ORDER BY n"
        if self.postgres_dsn:
            with psycopg.connect(self.postgres_dsn) as connection:
                return [(str(o), int(v)) for o, v in connection.execute(select).fetchall()]
        if self.kind == "database":
            with contextlib.closing(sqlite3.connect(self.sqlite_path(settings))) as db:
                return db.execute(select).fetchall()
        return list(dict.fromkeys(self.memory))

    def sqlite_path(self, settings: Settings) -> Path:
        return Path(settings.subscriber.data_dir) / f"{self.subscription.name}.sqlite"


async def place(client: httpx.AsyncClient, order_id: str) -> None:
    r = await client.post(f"/v1/orders/{order_id}/place", json={"customer_id": "c", "lines": [{"sku": "a", "qty": 1, "price": 1}]})
    assert r.status_code == 200, r.text


async def add_line(client: httpx.AsyncClient, order_id: str) -> None:
    r = await client.post(f"/v1/orders/{order_id}/add-line", json={"sku": "b", "qty": 1, "price": 2})
    assert r.status_code == 200, r.text


@asynccontextmanager
async def _bad_order(settings: Settings, recorder: Recorder, lines: int) -> AsyncIterator[tuple[System, SubscriptionOperations]]:
    """The system up, holding order "bad" placed with `lines` lines added: the events the
    recorder's handler refuses."""
    async with system(settings) as running:
        await place(running.client, "bad")
        for _ in range(lines):
            await add_line(running.client, "bad")
        yield running, SubscriptionOperations(settings, recorder.subscription, running.registry)


@pytest.mark.parametrize("kind", ["database", "postgres", "reactor", "side_effect"])
async def test_a_failing_aggregate_is_parked_in_order_and_retried_in_order(
    settings: Settings, tmp_path: Path, kind: str, request: pytest.FixtureRequest
) -> None:
    asyncio.get_running_loop().set_exception_handler(told_fences_quiet)  # as in esk's processes: a reactor's retry fences
    settings = subscriber_settings(settings, tmp_path / "subscriptions")
    recorder = Recorder(kind, request.getfixturevalue("postgres_dsn") if kind == "postgres" else None)
    async with system(settings) as running:
        client = running.client
        for order_id in ("bad", "good1", "good2"):
            await place(client, order_id)
        for order_id in ("bad", "good1", "bad", "good2"):
            await add_line(client, order_id)
        operations = SubscriptionOperations(settings, recorder.subscription, running.registry)
        async with subscriber(settings, recorder.subscription, running.registry) as member:
            await member.caught_up()
            applied = recorder.applied(settings)
            assert [a for a in applied if a[0] == "good1"] == [("good1", 1), ("good1", 2)]
            assert [a for a in applied if a[0] == "good2"] == [("good2", 1), ("good2", 2)]
            assert not [a for a in applied if a[0] == "bad"]
            parked = await operations.parked()
            assert [(p.aggregate_id, p.event_type) for p in parked] == [("bad", "Placed"), ("bad", "LineAdded"), ("bad", "LineAdded")]
            assert parked[0].reason == "RuntimeError: cannot take bad yet" and parked[0].attempts == FAST.attempts
            assert all(p.reason.startswith("waits behind") for p in parked[1:])

            # while it is parked, its next event waits behind too; the others' do not
            await add_line(client, "bad")
            await add_line(client, "good1")
            await wait_for(lambda: ("good1", 3) in recorder.applied(settings), what="good1's third event")
            await wait_for(lambda: _parked_count(operations, 4), what="bad's fourth event parked")
            status = await operations.status()  # as the store counts them, on every kind of store
            assert status.parked == 4 and sorted(p.parked for p in status.partitions if p.parked) == [4]

            recorder.broken = None  # the fix
            report = await operations.retry(None, by="tester")
            assert [(e.aggregate_id, e.offset) for e in report.handled] == [(p.aggregate_id, p.offset) for p in await operations.parked(True)]
            assert report.still_parked == []
            assert all(e.resolved_by == "tester" for e in report.handled)
            bad = [a for a in recorder.applied(settings) if a[0] == "bad"]
            assert bad == [("bad", 1), ("bad", 2), ("bad", 3), ("bad", 4)]

            # and it flows again
            await add_line(client, "bad")
            await wait_for(lambda: ("bad", 5) in recorder.applied(settings), what="bad's fifth event")
            assert await operations.parked() == []


async def test_a_retry_whose_unit_cannot_write_again_what_it_undid_leaves_the_events_parked(settings: Settings, tmp_path: Path) -> None:
    """A database handler's unit undoes its latest writes when an event fails and writes them
    again; a handler that succeeded, then fails when written again, loses the unit. The
    retry leaves that aggregate's events parked as they were and goes on (it ended the
    command with the unit's error, a review's find)."""
    settings = subscriber_settings(settings, tmp_path / "subscriptions")
    recorder = Recorder("database")
    async with _bad_order(settings, recorder, lines=1) as (running, operations):
        async with subscriber(settings, recorder.subscription, running.registry) as member:
            await member.caught_up()
            before = await operations.parked()
            assert [(p.aggregate_id, p.event_type) for p in before] == [("bad", "Placed"), ("bad", "LineAdded")]

            calls: dict[int, int] = {}

            def flaky(ctx: Context) -> None:  # version 1 takes once, then fails; version 2 never takes
                calls[ctx.version] = calls.get(ctx.version, 0) + 1
                if ctx.version == 2 or calls[ctx.version] > 1:
                    raise RuntimeError(f"cannot take {ctx.aggregate_id} v{ctx.version}")

            recorder._check = flaky  # type: ignore[method-assign]
            report = await operations.retry(None, by="tester")
            assert calls == {1: 2, 2: 1}
            assert report.handled == [] and [(p.aggregate_id, p.offset) for p in report.still_parked] == [(p.aggregate_id, p.offset) for p in before]
            assert [(p.offset, p.status, p.reason) for p in await operations.parked()] == [(p.offset, p.status, p.reason) for p in before]
            assert not [a for a in recorder.applied(settings) if a[0] == "bad"]


@pytest.mark.parametrize("kind", ["database", "reactor", "side_effect"])
async def test_a_skip_drops_the_event_that_failed_and_handles_those_that_waited_behind_it(
    settings: Settings, tmp_path: Path, kind: str
) -> None:
    # A reactor's skip fences the member's producer, a fence aiokafka also leaves on a
    # future nothing awaits: quiet, as in esk's processes.
    asyncio.get_running_loop().set_exception_handler(told_fences_quiet)
    settings = subscriber_settings(settings, tmp_path / "subscriptions")
    recorder = Recorder(kind)
    async with _bad_order(settings, recorder, lines=2) as (running, operations):
        async with subscriber(settings, recorder.subscription, running.registry) as member:
            await member.caught_up()
            parked = await operations.parked()
            assert [(p.event_type, p.reason.startswith("waits behind")) for p in parked] == [
                ("Placed", False), ("LineAdded", True), ("LineAdded", True)
            ]
            recorder.broken = None  # what followed the poison event is fine
            report = await operations.skip("bad", by="tester")
            assert [(e.event_type, e.status, e.resolved_by) for e in report.handled] == [
                ("Placed", "skipped", "tester"), ("LineAdded", "retried", "tester"), ("LineAdded", "retried", "tester")
            ]
            assert report.still_parked == [] and await operations.parked() == []
            assert [a for a in recorder.applied(settings) if a[0] == "bad"] == [("bad", 2), ("bad", 3)]
            await add_line(running.client, "bad")  # and it flows again
            await wait_for(lambda: ("bad", 4) in recorder.applied(settings), what="bad's fourth event")

        # A replay (the Kafka kinds' reset waits for no member) meets the handler refusing
        # the order again: parked again, each entry keeps how it was resolved the first time.
        recorder.broken = "bad"
        await operations.reset(None, keep_data=True)
        async with subscriber(settings, recorder.subscription, running.registry) as member:
            await member.caught_up()
            parked = await operations.parked()
        assert [(p.event_type, [(r.status, r.by) for r in p.earlier]) for p in parked] == [
            ("Placed", [("skipped", "tester")]), ("LineAdded", [("retried", "tester")]),
            ("LineAdded", [("retried", "tester")]), ("LineAdded", []),
        ]
        # A reset past events still parked marks them reset (kept, not dropped); the next
        # replay parks them with that too.
        await operations.reset(None, keep_data=True, by="ops")
        assert await operations.parked() == []
        assert {p.status for p in await operations.parked(True)} == {"reset"}
        async with subscriber(settings, recorder.subscription, running.registry) as member:
            await member.caught_up()
            again = await operations.parked()
        assert [[(r.status, r.by) for r in p.earlier] for p in again] == [
            [*[(r.status, r.by) for r in p.earlier], ("reset", "ops")] for p in parked
        ]
        # The offsets moved back without the marks (a reset stopped between the two, an
        # at-least-once unit's offset commit lost): the member marks them as it opens, and
        # each event is handled again and parked for what it is, not behind itself.
        await _offsets_back_without_marks(settings, recorder)
        async with subscriber(settings, recorder.subscription, running.registry) as member:
            await member.caught_up()
            third = await operations.parked()
        assert [(p.offset, p.reason, [(r.status, r.by) for r in p.earlier]) for p in third] == [
            (p.offset, p.reason, [*[(r.status, r.by) for r in p.earlier], ("reset", PASSED_AGAIN)]) for p in again
        ]
        assert third[0].reason == "RuntimeError: cannot take bad yet"


async def _offsets_back_without_marks(settings: Settings, recorder: Recorder) -> None:
    if recorder.kind != "database":
        group = group_id(settings, recorder.subscription)
        await commit_offsets_of_empty_group(settings, group, dict.fromkeys(await committed_offsets(settings, group), 0))
        return
    with contextlib.closing(sqlite3.connect(recorder.sqlite_path(settings))) as db, db:
        assert db.execute("UPDATE esk_offsets SET next_offset = 0").rowcount > 0


async def _parked_count(operations: SubscriptionOperations, count: int) -> bool:
    return len(await operations.parked()) == count


async def test_a_long_retry_holds_back_its_partition_only_and_the_member_stays_in_the_group(settings: Settings, tmp_path: Path) -> None:
    """Retries longer than max.poll.interval.ms: the loop keeps polling, other partitions flow."""
    settings = subscriber_settings(settings, tmp_path / "subscriptions")
    settings = settings.model_copy(update={"subscriber": settings.subscriber.model_copy(update={"max_poll_interval_ms": 3000})})
    slow, quick = _on_other_partitions(settings.topics.partitions)
    failures = {slow: 0}
    handled: list[str] = []
    patient = SideEffectHandler("patient", reads=[orders], retries=Retries(attempts=20, first_delay_s=2.0, max_delay_s=2.0))

    @patient.on(Placed)
    async def placed(event: Placed, ctx: Context) -> None:
        # the slow order fails until the other partition's order is through, and three
        # times at least: 6 s of retries, twice max.poll.interval.ms
        if ctx.aggregate_id == slow and (quick not in handled or failures[slow] < 3):
            failures[slow] += 1
            raise ConnectionError("the other side is down")
        handled.append(ctx.aggregate_id)

    async with system(settings) as running:
        async with subscriber(settings, patient, running.registry) as member:
            await member.caught_up()
            partitions = dict(member.runner.partitions)
            await place(running.client, slow)
            await wait_for(lambda: failures[slow] > 0, what="the first failure")
            await place(running.client, quick)
            await wait_for(lambda: quick in handled, what="the other partition's order, while the slow one is tried again")
            await wait_for(lambda: slow in handled, what="the slow order, at a later attempt")
            assert failures[slow] >= 3 and handled == [quick, slow]
            assert member.runner.partitions == partitions  # no rebalance took anything away
            assert await SubscriptionOperations(settings, patient, running.registry).parked() == []


def _on_other_partitions(partitions: int) -> tuple[str, str]:
    ids = [f"order-{n}" for n in range(100)]
    first = ids[0]
    other = next(i for i in ids if partition_for(i.encode(), partitions) != partition_for(first.encode(), partitions))
    return first, other
