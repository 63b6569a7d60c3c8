"""Reads a whole topic as read_committed readers see it (for checks, tools and tests)."""

from __future__ import annotations

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.structs import ConsumerRecord

from ..settings import Settings
from .client_options import client_options
from .metadata import topic_partitions


def committed_reader(settings: Settings, client_id: str | None = None) -> AIOKafkaConsumer:
    """A consumer outside any group that sees only committed records: what restores,
    replicas and checks read with. Make it inside the running loop; assign it partitions."""
    options = {"client_id": client_id} if client_id else {}
    return AIOKafkaConsumer(
        **client_options(settings), isolation_level="read_committed", enable_auto_commit=False, group_id=None, **options
    )


async def read_committed(settings: Settings, topic: str) -> list[ConsumerRecord[bytes, bytes]]:
    """Every committed record of `topic` up to its end offsets at the time of the call."""
    consumer = committed_reader(settings)
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in await topic_partitions(settings, topic)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        ends = await consumer.end_offsets(tps)
        records: list[ConsumerRecord[bytes, bytes]] = []
        pending = {tp for tp in tps if ends[tp] > 0}
        while pending:
            batches = await consumer.getmany(*pending, timeout_ms=1000, max_records=10_000)
            for batch in batches.values():
                records.extend(batch)
            for tp in list(pending):
                if await consumer.position(tp) >= ends[tp]:
                    pending.discard(tp)
        return records
    finally:
        await consumer.stop()
