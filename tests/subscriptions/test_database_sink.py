"""A DatabaseHandler's store, the same contract against both: a SQLite file and a real
PostgreSQL server, each shared by two members (two connections, as two processes have).
The offset row is a compare-and-set, so a member that lost its partition, or whose
partition was reset, commits nothing; a failing event is undone alone (savepoint)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest
from aiokafka import TopicPartition

from domain.orders import Placed, orders
from esk import DatabaseContext, DatabaseHandler, PostgreSQL, Retries, SQLite, run_subscription
from esk.protocol import EventRecord
from esk.subscriptions import database_sink
from esk.subscriptions.database import Database, DatabaseConfig
from esk.subscriptions.database_sink import ESK_TABLES, DatabaseSink, DatabaseUnit, load_parked, prepare, read_offsets, rewind
from esk.subscriptions.parking import ParkedEvent, ParkStatus, WrittenByNewerRelease
from esk.subscriptions.postgres import PostgresDatabase
from esk.subscriptions.routing import Router
from esk.subscriptions.sinks import Fenced, StartingPoint, Unit
from esk.subscriptions.worker import PartitionWorker

TP = TopicPartition("app.orders.events", 0)

ledger = DatabaseHandler("ledger", reads=[orders], schema=["CREATE TABLE IF NOT EXISTS written (member TEXT, n INTEGER)"])


@ledger.on(Placed)
async def _placed(event: Placed, ctx: DatabaseContext) -> None:
    raise AssertionError("not reached: these tests write through the unit's transaction directly")


Member = Callable[[], Awaitable[Database]]  # a new member's own connection to the one store


@pytest.fixture(params=["sqlite", "postgres"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> DatabaseConfig:
    if request.param == "sqlite":
        return SQLite(tmp_path / "ledger.sqlite")
    return PostgreSQL(request.getfixturevalue("postgres_dsn"))


@pytest.fixture
def member(store: DatabaseConfig, tmp_path: Path) -> Member:
    async def connect() -> Database:
        database = store.connect(tmp_path / "unused.sqlite")
        await prepare(database, ledger)
        return database

    return connect


async def write(sink: DatabaseSink, name: str, n: int, next_offset: int) -> None:
    unit = await sink.begin()
    assert isinstance(unit, DatabaseUnit)
    insert = "INSERT INTO written VALUES (%s, %s)" if isinstance(sink.database, PostgresDatabase) else "INSERT INTO written VALUES (?, ?)"
    await unit.transaction.sql.execute(insert, (name, n))
    await unit.commit(next_offset)


async def rows(database: Database) -> list[tuple[object, ...]]:
    async with database.transaction() as tx:
        return await tx.sql.fetchall("SELECT member, n FROM written ORDER BY n")


async def test_the_member_that_lost_the_partition_commits_nothing(member: Member) -> None:
    old_db, new_db = await member(), await member()
    old, new = DatabaseSink(old_db, ledger, TP), DatabaseSink(new_db, ledger, TP)
    assert (await old.open()).next_offset is None
    await write(old, "old", 1, next_offset=10)

    # the partition moves: the new member reads where the old one got to, and goes on
    assert (await new.open()).next_offset == 10
    await write(new, "new", 2, next_offset=20)

    # the old member, unaware, commits its next batch: the offset is not what it last wrote
    with pytest.raises(Fenced):
        await write(old, "old", 3, next_offset=20)
    assert await rows(new_db) == [("old", 1), ("new", 2)]
    async with new_db.transaction() as tx:
        assert await read_offsets(tx.esk, "ledger") == {TP: (20, 0)}
    await old_db.close()
    await new_db.close()


async def test_two_members_starting_together_cannot_both_write_the_first_offset(member: Member) -> None:
    a_db, b_db = await member(), await member()
    a, b = DatabaseSink(a_db, ledger, TP), DatabaseSink(b_db, ledger, TP)
    await a.open()
    await b.open()
    await write(b, "b", 1, next_offset=5)
    with pytest.raises(Fenced):
        await write(a, "a", 1, next_offset=5)
    assert await rows(a_db) == [("b", 1)]
    await a_db.close()
    await b_db.close()


async def test_a_reset_fences_the_running_member_and_marks_the_replay(member: Member) -> None:
    running_db, tool_db = await member(), await member()
    running = DatabaseSink(running_db, ledger, TP)
    await running.open()
    await write(running, "running", 1, next_offset=30)
    async with tool_db.transaction() as tx:
        await tx.sql.execute("DELETE FROM written")  # what an on_reset hook does
        await rewind(tx.esk, "ledger", {TP: 0}, "tool")
    with pytest.raises(Fenced):
        await write(running, "running", 2, next_offset=40)
    start = await DatabaseSink(running_db, ledger, TP).open()
    assert (start.next_offset, start.replay_until) == (0, 30)
    assert await rows(running_db) == []
    await running_db.close()
    await tool_db.close()


async def test_a_member_frozen_holding_the_offset_row_holds_the_new_owner_back_until_postgresql_ends_its_session(
    postgres_dsn: str,
) -> None:
    """PostgreSQL only: a SQLite file has one writer, who holds everyone back while frozen."""
    store = PostgreSQL(postgres_dsn, idle_in_transaction_timeout_s=3.0)
    old_db, new_db = store.connect(Path("unused")), store.connect(Path("unused"))
    for database in (old_db, new_db):
        await prepare(database, ledger)
    old, new = DatabaseSink(old_db, ledger, TP), DatabaseSink(new_db, ledger, TP)
    await old.open()
    await write(old, "old", 1, next_offset=10)
    assert (await new.open()).next_offset == 10  # the partition moved

    # The old member, unaware, has written its next batch and moved the offset row (which
    # it still finds as it left it), and is frozen before its COMMIT: it holds the row.
    stale = await old.begin()
    assert isinstance(stale, DatabaseUnit)
    await stale.transaction.sql.execute("INSERT INTO written VALUES (%s, %s)", ("old", 3))
    assert await old.move_offset(stale.transaction.esk, 20)

    writing = asyncio.create_task(write(new, "new", 2, next_offset=20))
    await asyncio.sleep(1.0)
    assert not writing.done(), "the new owner's update should wait for the row the frozen member holds"
    await asyncio.wait_for(writing, 30)  # PostgreSQL ended the frozen member's session

    # Thawed, the old member's commit finds its connection gone; its next unit runs on a new
    # connection, and the offset row fences it.
    with pytest.raises(psycopg.errors.IdleInTransactionSessionTimeout):
        await stale.transaction.commit()
    with pytest.raises(Fenced):
        await write(old, "old", 4, next_offset=30)
    assert await rows(new_db) == [("old", 1), ("new", 2)]
    async with new_db.transaction() as tx:
        assert await read_offsets(tx.esk, "ledger") == {TP: (20, 0)}
    await old_db.close()
    await new_db.close()


async def test_a_postgresql_session_ended_between_transactions_is_replaced_at_the_next(postgres_dsn: str) -> None:
    database, other = PostgreSQL(postgres_dsn, idle_in_transaction_timeout_s=3.0).connect(Path("unused")), PostgresDatabase(postgres_dsn)
    await prepare(database, ledger)
    await other.open()
    sink = DatabaseSink(database, ledger, TP)
    await sink.open()
    async with database.transaction() as tx:
        # each transaction carries the timeout (SET LOCAL: it holds behind a pooler too)
        assert await tx.sql.fetchone("SHOW idle_in_transaction_session_timeout") == ("3s",)
        row = await tx.sql.fetchone("SELECT pg_backend_pid()")
    assert row is not None
    async with other.transaction() as tx:  # a server restart, or an administrator, ends it
        assert await tx.sql.fetchone("SELECT pg_terminate_backend(%s)", (row[0],)) == (True,)
    await write(sink, "after", 1, next_offset=5)  # found lost at BEGIN: replaced, nothing lost
    assert await rows(other) == [("after", 1)]
    await database.close()
    await other.close()


async def test_a_transaction_left_open_by_a_rollback_cut_short_is_not_carried_into_the_next(postgres_dsn: str) -> None:
    """A stopped partition's task cancelled once more as it rolled back leaves its
    transaction open on the shared connection: the next unit's BEGIN would only warn, and
    commit what the lost unit wrote."""
    database = PostgresDatabase(postgres_dsn)
    await database.open()
    async with database.transaction() as tx:
        await tx.sql.execute("CREATE TABLE IF NOT EXISTS cut_short (written TEXT)")
    lost = await database.begin()
    await lost.sql.execute("INSERT INTO cut_short VALUES ('by the unit that was lost')")
    lost._end()  # as a rollback cut short leaves it: the lock released, the transaction open
    async with database.transaction() as tx:
        await tx.sql.execute("INSERT INTO cut_short VALUES ('by the next unit')")
    async with database.transaction() as tx:
        assert await tx.sql.fetchall("SELECT written FROM cut_short") == [("by the next unit",)]
    await database.close()


class _LostConnection:
    """A connection whose server is gone: every statement fails, and it knows it is closed."""

    closed = True

    def __init__(self) -> None:
        self.statements = 0

    async def execute(self, sql: str) -> None:
        self.statements += 1
        raise psycopg.OperationalError("server closed the connection unexpectedly")


async def test_a_begin_on_a_lost_connection_is_tried_once_more_on_a_new_one_then_fails() -> None:
    """No server: the retry's logic alone. A server that refuses every session must not keep
    the subscriber reconnecting in a loop."""
    made: list[_LostConnection] = []

    class AlwaysLost(PostgresDatabase):
        async def _connect(self) -> Any:
            made.append(_LostConnection())
            return made[-1]

    database = AlwaysLost("postgresql://localhost/nowhere")
    await database.open()
    with pytest.raises(psycopg.OperationalError):
        await asyncio.wait_for(database.begin(), 5)
    assert [connection.statements for connection in made] == [0, 1, 1]  # opened; replaced at BEGIN; once more
    assert not database.lock.locked()


async def test_postgresql_connections_give_up_a_silent_peer_unless_the_dsn_says_otherwise(postgres_dsn: str) -> None:
    for dsn, idle in ((postgres_dsn, "10"), (f"{postgres_dsn}{'&' if '?' in postgres_dsn else '?'}keepalives_idle=60", "60")):
        database = PostgresDatabase(dsn)
        await database.open()
        async with database.transaction() as tx:
            assert await tx.sql.fetchone("SELECT 1") == (1,)
        parameters = database._connection.info.get_parameters()  # type: ignore[union-attr]
        assert (parameters["keepalives"], parameters["keepalives_idle"], parameters["tcp_user_timeout"]) == ("1", idle, "30000")
        await database.close()


@pytest.mark.parametrize("timeout_s", [0, -1.0, float("nan"), float("inf")])
def test_postgresql_refuses_a_timeout_that_would_never_end_a_frozen_transaction(timeout_s: float) -> None:
    with pytest.raises(ValueError, match="idle_in_transaction_timeout_s"):
        PostgreSQL("postgresql://localhost/db", idle_in_transaction_timeout_s=timeout_s)


async def test_a_failing_event_is_undone_alone_and_its_aggregate_parked_in_order(store: DatabaseConfig) -> None:
    """The parking contract of tests/subscriptions/test_handlers.py, on each store."""
    counter = DatabaseHandler("counter", reads=[orders], schema=["CREATE TABLE IF NOT EXISTS counted (order_id TEXT, version INTEGER)"])
    insert = "INSERT INTO counted VALUES (%s, %s)" if isinstance(store, PostgreSQL) else "INSERT INTO counted VALUES (?, ?)"

    @counter.on(Placed)
    async def count(event: Placed, ctx: DatabaseContext) -> None:
        await ctx.db.execute(insert, (ctx.aggregate_id, ctx.version))
        if ctx.aggregate_id == "bad":
            raise RuntimeError("no")

    placed = Placed(customer_id="c", lines=[])
    run = await run_subscription(counter, [("bad", placed), ("good", placed), ("bad", placed)], database=store, retries=Retries(attempts=1))
    assert await run.query("SELECT order_id, version FROM counted ORDER BY order_id") == [("good", 1)]
    assert [(p.aggregate_id, p.offset, p.status.value) for p in run.parked] == [("bad", 0, "parked"), ("bad", 2, "parked")]
    await run.close()


def _failing_where(fails: Callable[[str], bool]) -> Callable[[str, DatabaseContext], Awaitable[None]]:
    """A `last` for `_counting` that raises where `fails` says."""

    async def last(order_id: str, ctx: DatabaseContext) -> None:
        if fails(order_id):
            raise RuntimeError(f"{order_id} fails")

    return last


@pytest.mark.parametrize("window", [database_sink.UNDO_WINDOW, 2])
async def test_the_events_before_a_failing_one_in_its_unit_are_written_once(
    store: DatabaseConfig, window: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A unit's events run without a savepoint each until one fails: then what the unit
    wrote before it (events handled, one parked behind another) since its latest mark is
    undone and written again, each alone, and the failing one's own write is gone."""
    monkeypatch.setattr(database_sink, "UNDO_WINDOW", window)
    calls: dict[str, int] = {}

    def fails(order_id: str) -> bool:
        calls[order_id] = calls.get(order_id, 0) + 1
        return order_id in ("bad", "worse")

    handler = _counting("once", _failing_where(fails), store)
    events = [("g1", PLACED), ("bad", PLACED), ("g2", PLACED), ("bad", PLACED), ("g3", PLACED), ("worse", PLACED), ("g4", PLACED)]
    run = await run_subscription(handler, events, database=store, retries=Retries(attempts=1))
    assert await run.query("SELECT order_id FROM counted ORDER BY order_id") == [("g1",), ("g2",), ("g3",), ("g4",)]
    # written again: what came since the unit's latest mark (with a window of 2, g2 was
    # before it); nothing else, and no event twice more (a unit that could not write them
    # again would start the partition over, handling each once more)
    assert calls == {"g1": 2, "bad": 1, "g2": 2 if window > 2 else 1, "g3": 2, "worse": 1, "g4": 1}
    assert [(p.aggregate_id, p.offset, p.reason) for p in run.parked] == [
        ("bad", 1, "RuntimeError: bad fails"),
        ("bad", 3, "waits behind an earlier parked event of 'bad'"),
        ("worse", 5, "RuntimeError: worse fails"),
    ]
    await run.close()


async def test_a_unit_whose_events_fail_when_written_again_commits_nothing_and_starts_over(store: DatabaseConfig) -> None:
    """An event that succeeded, undone with its unit when a later one failed, fails when it is
    written again: the unit commits nothing; the partition starts again, the failed event is
    tried alone, and everything is written once."""
    calls: dict[str, int] = {}

    def fails(order_id: str) -> bool:
        calls[order_id] = calls.get(order_id, 0) + 1
        return order_id == "bad" or (order_id == "flaky" and calls[order_id] == 2)

    handler = _counting("flaky_once", _failing_where(fails), store)
    run = await run_subscription(handler, [("flaky", PLACED), ("bad", PLACED), ("good", PLACED)], database=store, retries=Retries(attempts=1))
    assert calls["flaky"] == 3  # applied, failed when written again, applied as the partition started again
    assert await run.query("SELECT order_id FROM counted ORDER BY order_id") == [("flaky",), ("good",)]
    assert [(p.aggregate_id, p.reason) for p in run.parked] == [("bad", "RuntimeError: bad fails")]
    await run.close()


async def test_a_sqlite_handler_that_ends_its_transaction_is_parked_and_the_others_written_once(tmp_path: Path) -> None:
    """A statement that ends the transaction (SQLite rolls it all back on some errors; here
    the handler's own ROLLBACK) is told at that event, not at the next one or the commit."""
    store = SQLite(tmp_path / "ledger.sqlite")

    async def ends(order_id: str, ctx: DatabaseContext) -> None:
        if order_id == "ends":
            await ctx.db.execute("ROLLBACK")

    handler = _counting("ending", ends, store)
    run = await run_subscription(handler, [("before", PLACED), ("ends", PLACED), ("after", PLACED)], database=store, retries=Retries(attempts=1))
    assert await run.query("SELECT order_id FROM counted ORDER BY order_id") == [("after",), ("before",)]
    assert [(p.aggregate_id, p.reason) for p in run.parked] == [("ends", "OperationalError: the transaction was ended by a statement of the handler")]
    await run.close()


def _counting(name: str, last: Callable[[str, DatabaseContext], Awaitable[None]], store: DatabaseConfig | None = None) -> DatabaseHandler:
    """Counts each Placed in `counted` (one row an order: a second breaks the key), then
    does `last`; in `store`'s placeholders (None: PostgreSQL's)."""
    handler = DatabaseHandler(name, reads=[orders], schema=["CREATE TABLE IF NOT EXISTS counted (order_id TEXT PRIMARY KEY)"])
    insert = "INSERT INTO counted VALUES (?)" if isinstance(store, SQLite) else "INSERT INTO counted VALUES (%s)"

    @handler.on(Placed)
    async def count(event: Placed, ctx: DatabaseContext) -> None:
        await ctx.db.execute(insert, (ctx.aggregate_id,))
        await last(ctx.aggregate_id, ctx)

    return handler


PLACED = Placed(customer_id="c", lines=[])


async def test_a_handler_that_swallows_a_postgresql_error_as_its_last_statement_is_undone_alone_and_parked(postgres_dsn: str) -> None:
    """PostgreSQL aborts the whole transaction on an error, caught or not: the savepoint's
    release was the first to tell, outside what undoes the event alone, and its partition
    started again for ever, twice a second (a trial's find)."""

    async def insert_if_missing(order_id: str, ctx: DatabaseContext) -> None:
        if order_id == "swallow":
            with contextlib.suppress(psycopg.errors.UniqueViolation):  # the "insert if missing" of many handlers
                await ctx.db.execute("INSERT INTO counted VALUES (%s)", (order_id,))  # there already

    handler = _counting("swallowing", insert_if_missing)
    run = await run_subscription(handler, [("good", PLACED), ("swallow", PLACED), ("after", PLACED)], database=PostgreSQL(postgres_dsn),
                                 retries=Retries(attempts=2, first_delay_s=0.01))  # fmt: skip
    assert await run.query("SELECT order_id FROM counted ORDER BY order_id") == [("after",), ("good",)]
    [parked] = run.parked
    assert (parked.aggregate_id, parked.attempts) == ("swallow", 2) and "InFailedSqlTransaction" in parked.reason, parked.reason
    await run.close()


async def test_a_handler_slower_than_postgresql_s_idle_timeout_is_tried_alone_and_parked(postgres_dsn: str) -> None:
    """PostgreSQL ends the session of a transaction idle longer than the timeout: the
    handler's next statement finds the connection closed, and what came before it in the
    unit is gone too. The partition starts again, and the event met again is tried alone:
    it was started again from its committed offset for ever (a trial's find)."""

    async def slow(order_id: str, ctx: DatabaseContext) -> None:
        if order_id == "slow":
            await asyncio.sleep(1.5)
            await ctx.db.execute("SELECT 1")

    handler = _counting("slow_one", slow)
    run = await run_subscription(handler, [("good", PLACED), ("slow", PLACED), ("after", PLACED)],
                                 database=PostgreSQL(postgres_dsn, idle_in_transaction_timeout_s=0.5),
                                 retries=Retries(attempts=2, first_delay_s=0.01))  # fmt: skip
    assert await run.query("SELECT order_id FROM counted ORDER BY order_id") == [("after",), ("good",)]
    [parked] = run.parked
    assert (parked.aggregate_id, parked.attempts) == ("slow", 2), parked
    await run.close()


@pytest.mark.parametrize("events", [["good", "slow", "after"], ["good", "slow"]], ids=["before another", "last"])
async def test_a_handler_slower_than_postgresql_s_idle_timeout_after_its_last_statement_is_parked(
    postgres_dsn: str, events: list[str]
) -> None:
    """The session ended while the handler waited after its last statement: the client still
    sees the transaction open, so that is asked of the server at that event, not left to
    the next event's statement or the unit's commit (the partition started again for ever,
    a review's find)."""

    async def slow(order_id: str, ctx: DatabaseContext) -> None:
        if order_id == "slow":
            await asyncio.sleep(1.5)

    handler = _counting("slow_tail", slow)
    run = await run_subscription(handler, [(order_id, PLACED) for order_id in events],
                                 database=PostgreSQL(postgres_dsn, idle_in_transaction_timeout_s=0.5),
                                 retries=Retries(attempts=2, first_delay_s=0.01))  # fmt: skip
    assert await run.query("SELECT order_id FROM counted ORDER BY order_id") == sorted((e,) for e in events if e != "slow")
    [parked] = run.parked
    assert (parked.aggregate_id, parked.attempts) == ("slow", 2), parked
    await run.close()


async def test_an_aggregates_parked_events_are_resolved_by_one_unit_at_a_time(member: Member) -> None:
    """Retries from the command line and subscribers opening the partition, each in a
    transaction of its own: the next waits for the one before and finds what it left."""
    first_db, second_db, third_db = await member(), await member(), await member()
    first, second, third = (DatabaseSink(db, ledger, TP) for db in (first_db, second_db, third_db))
    await first.open()
    parked = [_parked("a", offset, "no") for offset in (3, 7)]
    unit = await first.begin()
    for event in parked:
        await unit.park(event)
    await unit.commit(None)

    resolving = await first.begin()
    assert [p.offset for p in await resolving.parked_to_resolve("a")] == [3, 7]

    async def take(sink: DatabaseSink) -> tuple[Unit, list[ParkedEvent]]:
        unit = await sink.begin()
        return unit, await unit.parked_to_resolve("a")

    waiting = asyncio.create_task(take(second))
    await asyncio.sleep(1.0)
    assert not waiting.done()
    await resolving.park(parked[0].resolved(ParkStatus.RETRIED, "test"))  # 7 failed again: it stays parked
    await resolving.commit(None)
    second_unit, left = await asyncio.wait_for(waiting, 10)
    assert [p.offset for p in left] == [7]

    # The second holds what was left, though the row it waited for is resolved.
    third_waiting = asyncio.create_task(take(third))
    await asyncio.sleep(1.0)
    assert not third_waiting.done()
    await second_unit.park(left[0].resolved(ParkStatus.SKIPPED, "test"))
    await second_unit.commit(None)
    third_unit, nothing = await asyncio.wait_for(third_waiting, 10)
    assert nothing == []
    await third_unit.abort()
    for db in (first_db, second_db, third_db):
        await db.close()


def _parked(aggregate_id: str, offset: int, reason: str) -> ParkedEvent:
    return ParkedEvent("ledger", TP.topic, TP.partition, offset, aggregate_id, "Placed", reason, 1, aggregate_id.encode(), b"{}", [])


async def test_a_partition_opens_knowing_why_each_aggregate_was_parked_first(member: Member) -> None:
    """What the worker decides from at its start (which aggregates a newer code version may
    take up), without a transaction per parked aggregate."""
    database = await member()
    sink = DatabaseSink(database, ledger, TP)
    await sink.open()
    unit = await sink.begin()
    for event in (_parked("b", 9, "waits behind"), _parked("a", 3, "no"), _parked("a", 7, "waits behind"), _parked("b", 5, "newer")):
        await unit.park(event)
    await unit.park(_parked("c", 1, "gone").resolved(ParkStatus.SKIPPED, "test"))
    await unit.commit(10)  # past them, in the unit that parked them, as the worker commits
    start = await DatabaseSink(database, ledger, TP).open()
    assert start.parked == {"a": "no", "b": "newer"} and start.parked_ahead == ()
    await database.close()


async def test_an_event_parked_again_where_one_was_resolved_keeps_how(member: Member) -> None:
    """A reset's replay parks an event that was skipped (or retried) before: the new entry
    holds who resolved the one before, and when. One still parked as a reset rewinds past
    it is marked reset, not dropped: parked once more, its entry holds both."""
    database = await member()
    sink = DatabaseSink(database, ledger, TP)
    await sink.open()
    unit = await sink.begin()
    assert await unit.entry_at(3) is None
    await unit.park(_parked("a", 3, "no").resolved(ParkStatus.SKIPPED, "alice"))
    await unit.commit(None)

    async def rewind_and_park_again(reason: str, by: str) -> ParkedEvent:
        async with database.transaction() as tx:
            await rewind(tx.esk, "ledger", {TP: 0}, by)
        unit = await sink.begin()
        await unit.park(_parked("a", 3, reason).after(await unit.entry_at(3)))
        await unit.commit(None)
        [entry] = await _all_parked(database)
        return entry

    entry = await rewind_and_park_again("still no", "bob")  # a skipped entry stays as it was
    assert (entry.status, entry.reason, [(r.status, r.by) for r in entry.earlier]) == (
        ParkStatus.PARKED, "still no", [(ParkStatus.SKIPPED, "alice")]
    )
    entry = await rewind_and_park_again("no again", "carol")  # a parked one is marked reset by carol
    assert (entry.status, entry.reason, entry.resolved_by) == (ParkStatus.PARKED, "no again", None)
    assert [(r.status, r.by, r.reason) for r in entry.earlier] == [
        (ParkStatus.SKIPPED, "alice", "no"), (ParkStatus.RESET, "carol", "still no")
    ]
    assert all(r.at is not None and r.at <= entry.parked_at for r in entry.earlier)
    await database.close()


async def test_an_entry_of_a_status_a_later_release_wrote_is_told_as_such(member: Member) -> None:
    """Read as any status this release knows, it could have an event handled twice or never."""
    database = await member()
    sink = DatabaseSink(database, ledger, TP)
    await sink.open()
    unit = await sink.begin()
    await unit.park(_parked("a", 3, "no").resolved(ParkStatus.SKIPPED, "alice"))
    await unit.commit(None)
    earlier = '[{"status":"expired","by":"later","at":1,"reason":"no"}]'
    async with database.transaction() as tx:
        await tx.esk.execute("UPDATE esk_parked SET earlier = ?", (earlier,))
    unit = await sink.begin()
    with pytest.raises(WrittenByNewerRelease, match=r"status this release does not know \(Invalid enum value 'expired'"):
        await unit.entry_at(3)
    await unit.abort()
    async with database.transaction() as tx:
        await tx.esk.execute("UPDATE esk_parked SET status = ?, earlier = ?", ("expired", "[]"))
    with pytest.raises(WrittenByNewerRelease, match=r"\('expired'\): a later esk wrote it; run that release on every member"):
        await _all_parked(database)  # what `esk subscriptions parked --all` reads
    await database.close()


def test_a_kafka_kinds_entry_of_a_status_a_later_release_wrote_is_told_as_such() -> None:
    written = _parked("a", 3, "no").encode().replace(b'"status":"parked"', b'"status":"expired"')
    with pytest.raises(WrittenByNewerRelease, match=r"Invalid enum value 'expired' - at `\$.status`\): a later esk wrote it"):
        ParkedEvent.decode(written)


async def test_members_starting_together_both_start_and_an_earlier_releases_table_gets_its_new_column(
    store: DatabaseConfig, tmp_path: Path
) -> None:
    """Two members of one subscription starting together make esk's tables and the new
    column of an `esk_parked` made before esk kept earlier resolutions, one after the other
    (PostgreSQL's CREATE TABLE IF NOT EXISTS fails the second of two at once), and the old
    table's rows read as before."""
    database = store.connect(tmp_path / "unused.sqlite")
    await database.open()
    old_table = ESK_TABLES[1].replace("earlier TEXT NOT NULL DEFAULT '[]',", "")
    assert old_table != ESK_TABLES[1]
    async with database.transaction() as tx:
        await tx.esk.execute(old_table)
        await tx.esk.execute(
            "INSERT INTO esk_parked (subscription, topic, kafka_partition, kafka_offset, aggregate_id, event_type, status, "
            "reason, attempts, parked_at, record_headers) VALUES ('ledger', ?, ?, 3, 'a', 'Placed', 'parked', 'no', 1, 0, '[]')",
            (TP.topic, TP.partition),
        )
    others = [store.connect(tmp_path / "unused.sqlite") for _ in range(2)]
    await asyncio.gather(*(prepare(other, ledger) for other in others))
    [entry] = await _all_parked(database)
    assert (entry.aggregate_id, entry.offset, entry.reason, entry.earlier) == ("a", 3, "no", ())
    for db in (database, *others):
        await db.close()


async def _all_parked(database: Database) -> list[ParkedEvent]:
    async with database.transaction() as tx:
        return await load_parked(tx.esk, "ledger", None)


def test_the_first_reason_of_each_aggregate_is_its_lowest_offsets_and_those_past_the_offset_are_ahead() -> None:
    parked = [("b", 9, "behind"), ("a", 7, "a7"), ("b", 5, "b5"), ("a", 8, "a8"), ("c", 12, "c12"), ("a", 10, "a10")]
    start = StartingPoint.of(10, 0, parked)
    assert start.parked == {"a": "a7", "b": "b5"}
    assert start.parked_ahead == (10, 12)
    nothing_committed = StartingPoint.of(None, 0, parked)
    assert nothing_committed.parked == {} and nothing_committed.parked_ahead == (5, 7, 8, 9, 10, 12)


async def test_parked_events_taken_up_whose_handler_loses_its_transaction_stay_parked(postgres_dsn: str) -> None:
    """esk takes up an aggregate's events parked for newer code as the partition opens; a
    handler slower than PostgreSQL's idle timeout ends the transaction, and the open failed,
    and the partition started again to fail so for ever (a review's find)."""
    from tests.subscriptions.test_handlers import NEWER_ORDERS, PlacedNewer, order_record

    store = PostgreSQL(postgres_dsn, idle_in_transaction_timeout_s=0.5)
    database = store.connect(Path("unused"))
    older = DatabaseHandler("taking_up", reads=[orders], schema=["CREATE TABLE IF NOT EXISTS seen (order_id TEXT)"])
    newer = DatabaseHandler("taking_up", reads=[NEWER_ORDERS], schema=["CREATE TABLE IF NOT EXISTS seen (order_id TEXT)"])

    @older.on(Placed)
    async def seen(event: Placed, ctx: DatabaseContext) -> None:
        await ctx.db.execute("INSERT INTO seen VALUES (%s)", (ctx.aggregate_id,))

    @newer.on(PlacedNewer)
    async def slow(event: PlacedNewer, ctx: DatabaseContext) -> None:
        await asyncio.sleep(1.5)  # its transaction idle past the timeout: PostgreSQL ends the session
        await ctx.db.execute("INSERT INTO seen VALUES (%s)", (ctx.aggregate_id,))

    placed = PLACED.model_dump(mode="json")
    record = EventRecord("orders/o1/1", "orders", "o1", 1, "Placed", PlacedNewer.schema_version, placed, "c", "c", "c", 0)
    await prepare(database, older)
    tp = TopicPartition("test.orders.events", 0)  # order_record's
    worker = PartitionWorker(older, Router(older, {"orders": orders}, "test"), DatabaseSink(database, older, tp), Retries(attempts=1))
    await worker.open()
    await worker.handle([order_record(0, "o1", "Placed", record.encode())], 1)  # parked: newer than this code
    assert worker.parked == {"o1"}

    upgraded = PartitionWorker(newer, Router(newer, {"orders": NEWER_ORDERS}, "test"), DatabaseSink(database, newer, tp), Retries(attempts=1))
    assert await upgraded.open() == 1  # it opens, the aggregate still parked
    assert upgraded.parked == {"o1"}
    async with database.transaction() as tx:
        [still] = await load_parked(tx.esk, newer.name)
        assert still.reason.startswith("undecodable: NewerSchemaVersion") and await tx.sql.fetchall("SELECT * FROM seen") == []
    await database.close()


async def test_a_handler_cancelled_on_a_connection_postgresql_ended_is_cancelled(postgres_dsn: str) -> None:
    """A stop or a revoke cancels a handler whose session PostgreSQL has ended meanwhile: the
    savepoint's and the unit's cleanup meet the closed connection, and their error took the
    cancellation's place, read as a failure to start again from: the task did not end."""
    store = PostgreSQL(postgres_dsn, idle_in_transaction_timeout_s=0.5)
    database = store.connect(Path("unused"))
    waiting = DatabaseHandler("waiting", reads=[orders], schema=["CREATE TABLE IF NOT EXISTS seen (order_id TEXT)"])
    started = asyncio.Event()

    @waiting.on(Placed)
    async def wait(event: Placed, ctx: DatabaseContext) -> None:
        started.set()
        await asyncio.sleep(60)

    from tests.subscriptions.test_handlers import order_record

    placed = PLACED.model_dump(mode="json")
    record = EventRecord("orders/o1/1", "orders", "o1", 1, "Placed", Placed.schema_version, placed, "c", "c", "c", 0)
    await prepare(database, waiting)
    tp = TopicPartition("test.orders.events", 0)
    worker = PartitionWorker(waiting, Router(waiting, {"orders": orders}, "test"), DatabaseSink(database, waiting, tp), Retries(attempts=1))
    await worker.open()
    handling = asyncio.create_task(worker.handle([order_record(0, "o1", "Placed", record.encode())], 1))
    await asyncio.wait_for(started.wait(), 10)
    await asyncio.sleep(1.5)  # PostgreSQL ends the session, idle in its transaction
    handling.cancel()
    with pytest.raises(asyncio.CancelledError):
        await handling
