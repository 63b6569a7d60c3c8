"""Replays against the real broker: `reset --to earliest` of a running database handler
runs its on_reset hook in the transaction that rewinds its offsets, the running member is
fenced and starts again from the beginning, and the table it rebuilds is the same; handlers
see `ctx.replaying` while the subscription is behind where it was. `--to <time>` replays
from the first event at or after that time."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest

from domain.orders import LineAdded, Placed, orders
from esk import DatabaseContext, DatabaseHandler
from esk.settings import Settings
from esk.subscriptions.operations import RefusedError, SubscriptionOperations
from subscriptions import customer_ledger
from tests.subscriptions.running import subscriber, subscriber_settings
from tests.system import system, wait_for

pytestmark = pytest.mark.kafka

watcher = DatabaseHandler(
    "watcher", reads=[orders], schema=["CREATE TABLE IF NOT EXISTS seen (order_id TEXT, version INTEGER, replaying INTEGER)"]
)


@watcher.on(Placed)
@watcher.on(LineAdded)
async def _seen(event: Placed | LineAdded, ctx: DatabaseContext) -> None:
    await ctx.db.execute("INSERT INTO seen VALUES (?, ?, ?)", (ctx.aggregate_id, ctx.version, ctx.replaying))


def query(settings: Settings, name: str, sql: str) -> list[tuple[object, ...]]:
    with contextlib.closing(sqlite3.connect(Path(settings.subscriber.data_dir) / f"{name}.sqlite")) as db:
        return db.execute(sql).fetchall()


async def orders_for(client: httpx.AsyncClient, order_ids: list[str]) -> None:
    for n, order_id in enumerate(order_ids):
        r = await client.post(f"/v1/orders/{order_id}/place", json={"customer_id": f"c{n % 3}", "lines": [{"sku": "a", "qty": 1, "price": 10 + n}]})
        assert r.status_code == 200, r.text
        r = await client.post(f"/v1/orders/{order_id}/add-line", json={"sku": "b", "qty": 2, "price": n})
        assert r.status_code == 200, r.text


async def caught_up(operations: SubscriptionOperations) -> bool:
    return (await operations.status()).caught_up


LEDGER = "SELECT customer_id, orders, total FROM customer_ledger ORDER BY customer_id"


async def test_reset_to_earliest_rebuilds_the_same_table_while_the_subscriber_runs(
    settings: Settings, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    settings = subscriber_settings(settings, tmp_path / "subscriptions")
    caplog.set_level(logging.INFO, logger="esk")
    async with system(settings) as running:
        await orders_for(running.client, [f"o{n}" for n in range(12)])
        ledger_operations = SubscriptionOperations(settings, customer_ledger, running.registry)
        watcher_operations = SubscriptionOperations(settings, watcher, running.registry)
        async with subscriber(settings, customer_ledger, running.registry), subscriber(settings, watcher, running.registry):
            await wait_for(lambda: caught_up(ledger_operations), what="the ledger to catch up")
            await wait_for(lambda: caught_up(watcher_operations), what="the watcher to catch up")
            before = query(settings, "customer_ledger", LEDGER)
            assert sum(int(str(orders_placed)) for _, orders_placed, _ in before) == 12

            await ledger_operations.reset(None)
            with pytest.raises(RefusedError, match="has no on_reset: its tables keep what they hold"):
                await watcher_operations.reset(None)  # nothing clears its rows: not without a word
            await watcher_operations.reset(None, keep_data=True)  # it records each delivery, replays too
            await wait_for(lambda: caught_up(ledger_operations), what="the ledger's replay")
            await wait_for(lambda: caught_up(watcher_operations), what="the watcher's replay")
            assert query(settings, "customer_ledger", LEDGER) == before
            # the members learn of the reset from the fence: an operator's act, told as such
            fenced = [r for r in caplog.records if "moved under this member" in r.getMessage()]
            assert fenced, caplog.text
            assert all(r.levelno == logging.INFO and "from where its offset stands now" in r.getMessage() for r in fenced), caplog.text

            await orders_for(running.client, ["o-after"])
            await wait_for(lambda: ("o-after", 2, 0) in query(settings, "watcher", "SELECT * FROM seen"), what="a new order")
        seen = query(settings, "watcher", "SELECT order_id, version, replaying FROM seen")
        first, replayed, new = seen[:24], seen[24:48], seen[48:]
        assert sorted(first) == sorted((o, v, 0) for o in [f"o{n}" for n in range(12)] for v in (1, 2))
        assert sorted(replayed) == sorted((o, v, 1) for o, v, _ in first)  # no on_reset: it sees everything twice
        assert new == [("o-after", 1, 0), ("o-after", 2, 0)]


async def test_reset_to_a_time_replays_from_there(settings: Settings, tmp_path: Path) -> None:
    settings = subscriber_settings(settings, tmp_path / "subscriptions")
    async with system(settings) as running:
        await orders_for(running.client, ["early"])
        await asyncio.sleep(0.5)
        middle = datetime.now(UTC)
        await asyncio.sleep(0.5)
        await orders_for(running.client, ["late"])
        operations = SubscriptionOperations(settings, watcher, running.registry)
        async with subscriber(settings, watcher, running.registry):
            await wait_for(lambda: caught_up(operations), what="the watcher to catch up")
            # a database handler's on_reset clears all its replay from the earliest writes
            # again; from a time, only with its tables kept as they are
            with pytest.raises(RefusedError, match=r"replays from .* only the events since then, while its on_reset clears"):
                await SubscriptionOperations(settings, customer_ledger, running.registry).reset(middle)
            with pytest.raises(RefusedError, match=r"replays from .* only the events since then, into tables that hold them"):
                await operations.reset(middle)
            await operations.reset(middle, keep_data=True)
            await wait_for(lambda: len(query(settings, "watcher", "SELECT * FROM seen")) == 6, what="the replay")
        assert query(settings, "watcher", "SELECT order_id, version, replaying FROM seen WHERE replaying = 1") == [("late", 1, 1), ("late", 2, 1)]
