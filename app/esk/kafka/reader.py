"""Readers outside any group: a whole topic as read_committed readers see it (for checks,
tools and tests), and where a transaction is still open on a partition."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.structs import ConsumerRecord

from ..settings import Settings
from .client_options import client_options
from .metadata import topic_partitions
from .stopping import stop_consumer


def committed_reader(settings: Settings, client_id: str | None = None) -> AIOKafkaConsumer:
    """A consumer outside any group that sees only committed records: what restores,
    replicas and checks read with. Make it inside the running loop; assign it partitions."""
    return lone_reader(settings, "read_committed", client_id)


def lone_reader(settings: Settings, isolation_level: str, client_id: str | None = None) -> AIOKafkaConsumer:
    """A consumer outside any group (read_uncommitted: its end offsets are the partitions'
    high watermarks). Make it inside the running loop."""
    options = {"client_id": client_id} if client_id else {}
    return AIOKafkaConsumer(
        **client_options(settings), isolation_level=isolation_level, enable_auto_commit=False, group_id=None, **options
    )


def group_member(
    settings: Settings, group_id: str, session_timeout_ms: int, max_poll_interval_ms: int, **options: Any
) -> AIOKafkaConsumer:
    """A read_committed member of `group_id` that commits its offsets itself (in a
    transaction, or in its own database), starting from the earliest offset when the group
    has none. Make it inside the running loop."""
    return AIOKafkaConsumer(
        **client_options(settings),
        group_id=group_id,
        client_id=f"{group_id}-consumer",
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        isolation_level="read_committed",
        session_timeout_ms=session_timeout_ms,
        heartbeat_interval_ms=max(session_timeout_ms // 4, 500),
        max_poll_interval_ms=max_poll_interval_ms,
        **options,
    )


OpenTransactions = Callable[[list[TopicPartition]], Awaitable[dict[TopicPartition, tuple[int, int]]]]


@contextlib.asynccontextmanager
async def transaction_watch(settings: Settings) -> AsyncIterator[OpenTransactions]:
    """A look at where a transaction is still open, for as many looks as a wait takes on the
    same pair of readers (not a pair started and stopped on each). Each look answers with
    the partitions of those asked where one is open, each with its last stable offset (where
    its first open transaction starts, and where a read_committed reader stops) and its high
    watermark."""
    committed, everything = committed_reader(settings), lone_reader(settings, "read_uncommitted")

    async def open_transactions(tps: list[TopicPartition]) -> dict[TopicPartition, tuple[int, int]]:
        stable, high = await asyncio.gather(committed.end_offsets(tps), everything.end_offsets(tps))
        return {tp: (stable[tp], high[tp]) for tp in tps if stable[tp] < high[tp]}

    try:
        await asyncio.gather(committed.start(), everything.start())
        yield open_transactions
    finally:
        await asyncio.gather(stop_consumer(committed), stop_consumer(everything))


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
        await stop_consumer(consumer)
