"""A frozen member writes nothing for the partitions it lost, in SQLite and in PostgreSQL.

Two `esk subscriber positions` processes of a user's project share the partitions; one is
frozen (SIGSTOP) until the group has given all of them to the other, which goes on writing,
then thawed (SIGCONT) with a unit of work it had begun before the freeze. Every event must be
in the table exactly once: a stale unit that committed would write events the other member
wrote too.

With PostgreSQL the frozen member is caught with its transaction open (pg_stat_activity says
"idle in transaction"), so the thawed member is certain to try to commit stale work. With
SQLite, one writer holds the file at a time: a member frozen inside its transaction holds
everyone back until it is thawed, and the offset row (compared and set in that same
transaction) decides which of the two commits counts.
"""

from __future__ import annotations

import asyncio
import random
import signal
import sqlite3
import subprocess
from collections.abc import Iterator
from contextlib import closing, contextmanager
from pathlib import Path
from typing import Any

import psycopg
import pytest

from esk.kafka.groups import group_members
from esk.settings import Settings
from tests.subscriptions.user_project import UserProject, send_counter_commands
from tests.system import wait_for

pytestmark = pytest.mark.kafka

# Each event is written as its own row, by the member (process id) that applied it; the
# handler waits a little inside the transaction, so a member is nearly always in the middle
# of a unit of work when it is frozen.
POSITIONS = {
    "shop/positions.py": """
        import asyncio
        import os

        from esk import DatabaseContext, DatabaseHandler, PostgreSQL

        from shop.counters import Added, counters

        DSN = os.environ.get("SHOP_DSN")
        MARK = "%s" if DSN else "?"
        # so that the test can tell this process's connections in pg_stat_activity
        NAMED = f"{DSN}{'&' if '?' in (DSN or '') else '?'}application_name=member-{os.getpid()}"

        positions = DatabaseHandler(
            "positions",
            reads=[counters],
            database=PostgreSQL(NAMED) if DSN else None,
            schema=[
                "CREATE TABLE IF NOT EXISTS applied "
                "(kafka_partition INTEGER, kafka_offset BIGINT, counter TEXT, n INTEGER, member INTEGER)"
            ],
        )


        @positions.on(Added)
        async def added(event: Added, ctx: DatabaseContext) -> None:
            await asyncio.sleep(0.005)
            await ctx.db.execute(
                f"INSERT INTO applied VALUES ({MARK}, {MARK}, {MARK}, {MARK}, {MARK})",
                (ctx.partition, ctx.offset, ctx.aggregate_id, event.n, os.getpid()),
            )


        SUBSCRIPTIONS = [positions]
    """,
}
COUNTERS, ADDS_EACH = 20, 40


class Table:
    """The `applied` table, read by the test, in whichever store the subscription uses."""

    def __init__(self, project: UserProject, dsn: str | None) -> None:
        self.sqlite = project.root / ".esk" / "subscriptions" / "positions.sqlite"
        self.dsn = dsn

    def query(self, sql: str) -> list[tuple[Any, ...]]:
        try:
            if self.dsn is not None:
                with psycopg.connect(self.dsn, autocommit=True) as db:
                    return list(db.execute(sql).fetchall())
            if not self.sqlite.exists():
                return []
            with closing(sqlite3.connect(self.sqlite, timeout=30)) as db:
                return list(db.execute(sql).fetchall())
        except (sqlite3.OperationalError, psycopg.errors.UndefinedTable):  # not created yet
            return []

    def count(self, where: str = "TRUE") -> int:
        rows = self.query(f"SELECT count(*) FROM applied WHERE {where}")
        return int(rows[0][0]) if rows else 0

    def rows_by(self, member: int) -> int:
        return self.count(f"member = {member}")

    def beyond(self, member: int, high: dict[int, int]) -> set[int]:
        """The partitions where `member` wrote an event after offset `high[partition]`."""
        return {p for p, top in self.query(f"SELECT kafka_partition, max(kafka_offset) FROM applied WHERE member = {member} GROUP BY kafka_partition")
                if p in high and top > high[p]}

    def in_a_transaction(self, member: int) -> bool:
        """PostgreSQL: `member` has a transaction open (and is doing nothing in it, frozen)."""
        assert self.dsn is not None
        return bool(self.query(
            f"SELECT pid FROM pg_stat_activity WHERE application_name = 'member-{member}' AND state = 'idle in transaction'"
        ))


async def group_has(settings: Settings, group: str, members: int) -> bool:
    return len(await group_members(settings, group)) == members


@contextmanager
def stopped(process: subprocess.Popen[bytes]) -> Iterator[None]:
    """`process` is stopped (SIGSTOP): thaw it on the way out, whatever happens."""
    try:
        yield
    finally:
        process.send_signal(signal.SIGCONT)


@pytest.fixture(params=["sqlite", "postgres"])
def dsn(request: pytest.FixtureRequest) -> str | None:
    return request.getfixturevalue("postgres_dsn") if request.param == "postgres" else None


async def test_a_frozen_member_writes_nothing_for_the_partitions_it_lost(settings: Settings, tmp_path: Path, dsn: str | None) -> None:
    env = {"ESK_SUBSCRIPTIONS": "shop.positions:SUBSCRIPTIONS"} | ({"SHOP_DSN": dsn} if dsn else {})
    project = UserProject(tmp_path / "project", settings, POSITIONS, env)
    await project.create_topics()
    table = Table(project, dsn)
    group = f"{settings.app}.subscription.positions"
    processor = project.start("processor")
    first = project.start("subscriber", "positions", log_name="first")
    second: subprocess.Popen[bytes] | None = None
    sending = asyncio.create_task(send_counter_commands(settings, random.Random(11), COUNTERS, ADDS_EACH, pause_s=0.3))
    try:
        await wait_for(lambda: table.rows_by(first.pid) > 0, 90, "the first member to write")
        second = project.start("subscriber", "positions", log_name="second")
        await wait_for(lambda: table.rows_by(second.pid) > 0, 90, "the second member to take partitions and write")
        await wait_for(lambda: group_has(settings, group, 2), 60, "a stable group of two")
        for _ in range(50):  # freeze the first member in the middle of a unit of work
            await asyncio.sleep(random.uniform(0.0, 0.1))
            first.send_signal(signal.SIGSTOP)
            if dsn is None or table.in_a_transaction(first.pid):
                break
            first.send_signal(signal.SIGCONT)
        else:
            pytest.fail("the first member was never caught inside a transaction")
        with stopped(first):
            high = dict(table.query("SELECT kafka_partition, max(kafka_offset) FROM applied GROUP BY kafka_partition"))
            await wait_for(lambda: group_has(settings, group, 1), 90, "the group to give every partition to the second member")
            if dsn is not None:  # with SQLite the frozen member's open transaction holds the file
                await wait_for(
                    lambda: table.beyond(second.pid, high) == set(high), 60, "the second member to write past the freeze everywhere"
                )
        expected = await sending
        added = sum(events for events, _ in expected.values())
        await wait_for(lambda: table.count() >= added, 120, "every event applied")
        await asyncio.sleep(2)  # and nothing more comes afterwards

        duplicates = table.query(
            "SELECT kafka_partition, kafka_offset, count(*) FROM applied GROUP BY kafka_partition, kafka_offset HAVING count(*) > 1"
        )
        assert duplicates == [], f"written twice: {duplicates}"
        rows = table.query("SELECT counter, count(*), sum(n) FROM applied GROUP BY counter")
        totals = {counter: (int(events), int(total)) for counter, events, total in rows}
        assert totals == expected
    finally:
        sending.cancel()
        for process in (processor, first, second):
            if process is not None:
                process.send_signal(signal.SIGCONT)
                process.terminate()
                process.wait(30)
