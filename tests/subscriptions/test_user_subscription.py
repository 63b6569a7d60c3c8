"""The promise to a new user, end to end: a subscription for their own aggregate, in their own
module, written with `import esk` alone, run with one command (`esk subscriber tally`, from
their project's directory), SIGKILLed mid-stream and started again, has applied every event
exactly once."""

from __future__ import annotations

import asyncio
import contextlib
import random
import sqlite3
from pathlib import Path

import pytest

from esk.settings import Settings
from tests.subscriptions.user_project import UserProject, send_counter_commands
from tests.system import wait_for

pytestmark = pytest.mark.kafka

TALLY = {
    "shop/tally.py": """
        from esk import DatabaseContext, DatabaseHandler

        from shop.counters import Added, counters

        tally = DatabaseHandler(
            "tally",
            reads=[counters],
            schema=["CREATE TABLE IF NOT EXISTS tally (counter TEXT PRIMARY KEY, events INTEGER, total INTEGER)"],
        )


        @tally.on(Added)
        async def added(event: Added, ctx: DatabaseContext) -> None:
            await ctx.db.execute(
                "INSERT INTO tally VALUES (?, 1, ?) "
                "ON CONFLICT (counter) DO UPDATE SET events = events + 1, total = total + excluded.total",
                (ctx.aggregate_id, event.n),
            )


        SUBSCRIPTIONS = [tally]
    """,
}
COUNTERS, ADDS_EACH = 20, 25


def tally(project: Path) -> dict[str, tuple[int, int]]:
    path = project / ".esk" / "subscriptions" / "tally.sqlite"
    if not path.exists():
        return {}
    with contextlib.closing(sqlite3.connect(path)) as db:
        try:
            return {counter: (events, total) for counter, events, total in db.execute("SELECT * FROM tally")}
        except sqlite3.OperationalError:  # not created yet
            return {}


async def test_a_users_subscription_applies_every_event_once_across_kill_9(settings: Settings, tmp_path: Path) -> None:
    project = UserProject(tmp_path / "my-project", settings, TALLY, {"ESK_SUBSCRIPTIONS": "shop.tally:SUBSCRIPTIONS"})
    await project.create_topics()
    start = project.start
    processor, subscriber = start("processor"), start("subscriber", "tally")
    rng = random.Random(7)
    try:
        sending = asyncio.create_task(send_counter_commands(settings, rng, COUNTERS, ADDS_EACH, pause_s=0.4))
        for _ in range(2):
            # mid-stream: once it has applied something and while commands keep coming
            before = sum(events for events, _ in tally(project.root).values())
            await wait_for(lambda before=before: sum(e for e, _ in tally(project.root).values()) > before, 90, "the subscriber to apply events")
            await asyncio.sleep(rng.uniform(0.0, 1.0))
            subscriber.kill()
            subscriber.wait()
            subscriber = start("subscriber", "tally")
        expected = await sending
        await wait_for(lambda: tally(project.root) == expected, 90, "every event applied")
        await asyncio.sleep(2)  # and nothing more comes afterwards
        assert tally(project.root) == expected
    finally:
        for process in (processor, subscriber):
            process.terminate()
            process.wait(30)
