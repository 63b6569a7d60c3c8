"""A consumer stopped while its broker is away: aiokafka's own stop lets the cancellation
of a fetch waiting out its retry backoff escape into the caller; `stop_consumer` ends
without it, and a cancellation of the caller itself still propagates. A broker of the
test's own, stopped under the consumers."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from esk.broker import EmbeddedBroker
from esk.broker.ports import free_port_pair
from esk.kafka.stopping import stop_consumer
from esk.settings import BrokerSettings

pytestmark = pytest.mark.kafka

TOPIC = "stopping"

Consumers = Callable[[int], Awaitable[list[AIOKafkaConsumer]]]


@pytest.fixture
async def polling_a_broker_gone(tmp_path: Path) -> AsyncIterator[Consumers]:
    """`n` consumers that polled their broker, as esk's do, until it went away a few
    seconds ago: their fetches fail, each then waiting out its retry backoff."""
    broker = EmbeddedBroker(BrokerSettings(port=free_port_pair(), data_dir=tmp_path / "broker"))
    await asyncio.to_thread(broker.start)
    made: list[AIOKafkaConsumer] = []

    async def poll(consumer: AIOKafkaConsumer) -> None:
        while True:
            await consumer.getmany(timeout_ms=500)

    async def consumers(n: int) -> list[AIOKafkaConsumer]:
        admin = AIOKafkaAdminClient(bootstrap_servers=broker.bootstrap)
        await admin.start()
        try:
            await admin.create_topics([NewTopic(TOPIC, 1, 1)])
        finally:
            await admin.close()
        for _ in range(n):
            made.append(AIOKafkaConsumer(bootstrap_servers=broker.bootstrap))
            await made[-1].start()
            made[-1].assign([TopicPartition(TOPIC, 0)])
        polling = [asyncio.create_task(poll(consumer)) for consumer in made]
        await asyncio.sleep(2)
        await asyncio.to_thread(broker.stop)
        await asyncio.sleep(5)
        for task in polling:
            task.cancel()
        await asyncio.gather(*polling, return_exceptions=True)
        return made

    try:
        yield consumers
    finally:
        await asyncio.to_thread(broker.stop)
        for consumer in made:  # those a test left running
            with contextlib.suppress(BaseException):
                await consumer.stop()


async def test_a_consumer_stopped_while_its_broker_is_away_stops_without_a_cancellation(
    polling_a_broker_gone: Consumers,
) -> None:
    raw, helped = await polling_a_broker_gone(2)
    # What esk works around: aiokafka's stop raises a cancellation nobody asked for. Should
    # aiokafka fix it, this fails and `stop_consumer` can go.
    with pytest.raises(asyncio.CancelledError):
        await raw.stop()
    await stop_consumer(helped)
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]


async def test_a_cancelled_caller_is_still_cancelled(polling_a_broker_gone: Consumers) -> None:
    [consumer] = await polling_a_broker_gone(1)
    stopping = asyncio.create_task(stop_consumer(consumer))
    await asyncio.sleep(0)  # inside the consumer's stop
    stopping.cancel()
    with pytest.raises(asyncio.CancelledError):
        await stopping
    assert stopping.cancelled()
