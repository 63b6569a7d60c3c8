"""A subscriber asked to stop (SIGTERM) lets the chunks in hand go on to their commit, for a
bounded time, against the real broker: a rollout would otherwise throw away up to a fetch of
handled work, for the partition's next owner to do all over again."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

import pytest

from domain.orders import Placed, orders
from esk import DatabaseContext, DatabaseHandler
from esk.settings import Settings
from tests.subscriptions.running import subscriber, subscriber_settings
from tests.system import system

pytestmark = pytest.mark.kafka

in_hand = asyncio.Event()  # set once the handler has written the order's row
HANDLER_S = 1.5

slow = DatabaseHandler("stopping_ledger", reads=[orders], schema=["CREATE TABLE IF NOT EXISTS seen (order_id TEXT)"])


@slow.on(Placed)
async def placed(event: Placed, ctx: DatabaseContext) -> None:
    await ctx.db.execute("INSERT INTO seen VALUES (?)", (ctx.aggregate_id,))
    in_hand.set()
    await asyncio.sleep(HANDLER_S)  # a slow handler: the stop comes while its chunk is in hand


def _seen(data_dir: Path) -> list[tuple[object, ...]]:
    with sqlite3.connect(data_dir / "stopping_ledger.sqlite") as db:
        return db.execute("SELECT order_id FROM seen").fetchall()


@pytest.mark.parametrize("grace_s", [30.0, 0.0])
async def test_a_stop_lets_the_chunk_in_hand_commit_within_its_grace(settings: Settings, tmp_path: Path, grace_s: float) -> None:
    in_hand.clear()
    data_dir = tmp_path / "subscriptions"
    settings = subscriber_settings(settings, data_dir)
    settings = settings.model_copy(update={"subscriber": settings.subscriber.model_copy(update={"stop_grace_s": grace_s})})
    order = {"customer_id": "c1", "lines": [{"sku": "a", "qty": 1, "price": 1}]}
    async with system(settings) as s:
        assert (await s.client.post("/v1/orders/o-stop/place", json=order)).status_code == 200
        async with subscriber(settings, slow, s.registry) as running:
            await asyncio.wait_for(in_hand.wait(), 60)
            await running.shutdown()  # as SIGTERM asks
    # with a grace, its row and offset committed; without one, given up for the next owner
    assert _seen(data_dir) == ([("o-stop",)] if grace_s else [])
