"""Topic metadata that aiokafka only has after a refresh."""

from __future__ import annotations

import asyncio

from aiokafka import AIOKafkaConsumer


async def topic_partitions(consumer: AIOKafkaConsumer, topic: str, timeout_s: float = 10.0) -> list[int]:
    """The partitions of `topic`; raises if the topic does not exist."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        partitions = consumer.partitions_for_topic(topic)
        if partitions:
            return sorted(partitions)
        if asyncio.get_running_loop().time() > deadline:
            raise LookupError(f"topic {topic} not found: run `esk topics init`")
        await consumer._client.force_metadata_update()  # noqa: SLF001 - no public refresh in aiokafka
        await asyncio.sleep(0.05)
