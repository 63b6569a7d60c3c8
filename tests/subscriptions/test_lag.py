"""`esk_subscription_lag` against the real broker: the records of each partition past its
committed position, as the partition's end stands now, not as the last fetch saw it (the
partition is paused while its worker has a chunk in hand, or starts again)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from domain.orders import Placed, orders
from esk import DatabaseContext, DatabaseHandler
from esk.kafka.partitioner import partition_for
from esk.settings import Settings
from esk.subscriptions import runner
from tests.subscriptions.running import subscriber, subscriber_settings
from tests.system import events_topic, system, wait_for

pytestmark = pytest.mark.kafka

held = asyncio.Event()  # set once the handler holds the first order's chunk
go_on = asyncio.Event()

slow = DatabaseHandler("slow_ledger", reads=[orders], schema=["CREATE TABLE IF NOT EXISTS seen (order_id TEXT)"])


@slow.on(Placed)
async def placed(event: Placed, ctx: DatabaseContext) -> None:
    held.set()
    await go_on.wait()  # a slow handler: its chunk's unit stays open meanwhile


async def test_the_lag_counts_what_came_while_a_chunk_is_in_hand(settings: Settings, tmp_path: Path) -> None:
    settings = subscriber_settings(settings, tmp_path / "subscriptions")
    order = {"customer_id": "c1", "lines": [{"sku": "a", "qty": 1, "price": 1}]}
    topic = events_topic(settings, "orders")
    partition = str(partition_for(b"held", settings.topics.partitions))

    def lag() -> float | None:
        return REGISTRY.get_sample_value("esk_subscription_lag", {"subscription": "slow_ledger", "topic": topic, "partition": partition})

    async with system(settings) as s:
        assert (await s.client.post("/v1/orders/held/place", json=order)).status_code == 200
        async with subscriber(settings, slow, s.registry):
            await asyncio.wait_for(held.wait(), 60)
            for _ in range(5):  # its partition's next records, come while the first is in hand
                assert (await s.client.post("/v1/orders/held/add-line", json={"sku": "b", "qty": 1, "price": 1})).status_code == 200
            # six records (and their transactions' markers, which take offsets too)
            await wait_for(lambda: (lag() or 0) >= 6, timeout_s=10 * runner.LAG_REPORT_S, what="the lag to count all six")
            go_on.set()
            await wait_for(lambda: lag() == 0, timeout_s=60, what="the lag to come down once they are handled")
