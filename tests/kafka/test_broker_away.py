"""A producer sending while its broker goes away, against a broker of the test's own:
aiokafka's sender, holding batches for partitions whose leader it lost, asked for metadata
again the moment each update failed (about 6,000 a second, a core of CPU, for as long as
the batches waited); esk's clients back off between failed updates (client_options)."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

import esk.kafka.client_options  # noqa: F401  (what every esk client is made with)
from esk.broker import EmbeddedBroker
from esk.broker.ports import free_port_pair
from esk.settings import BrokerSettings

pytestmark = pytest.mark.kafka


async def test_a_producer_whose_broker_went_away_mid_send_asks_for_metadata_at_its_backoff(tmp_path: Path) -> None:
    broker = EmbeddedBroker(BrokerSettings(port=free_port_pair(), data_dir=tmp_path / "broker"))
    await asyncio.to_thread(broker.start)
    bootstrap = f"127.0.0.1:{broker.settings.port}"
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic("away", 1, 1)])
    finally:
        await admin.close()
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", enable_idempotence=True, linger_ms=1, retry_backoff_ms=100)
    await producer.start()
    updates = 0
    update = producer.client._metadata_update

    async def counted(*args: Any) -> bool:
        nonlocal updates
        updates += 1
        return bool(await update(*args))

    producer.client._metadata_update = counted

    async def send_on() -> None:  # an API's commands: sends in flight as the broker goes
        while True:
            with contextlib.suppress(Exception):
                (await producer.send("away", b"x", key=b"k")).add_done_callback(lambda sent: sent.exception())
            await asyncio.sleep(0.01)

    sending = asyncio.create_task(send_on())
    try:
        await asyncio.sleep(1)
        await asyncio.to_thread(broker.stop)
        await asyncio.sleep(1)  # the batches fail over to asking for metadata
        before = updates
        await asyncio.sleep(3)
        asked = updates - before
    finally:
        sending.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sending
        with contextlib.suppress(Exception):
            await asyncio.wait_for(producer.stop(), 2)  # with batches it cannot send
        with contextlib.suppress(Exception):
            await producer.client.close()
    # one update a backoff (100 ms), and the periodic ones besides: 30 and a few in 3 s
    assert 3 <= asked <= 60, asked
