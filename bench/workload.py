"""The accounts workload of W1: commands written straight onto the commands topic."""

from __future__ import annotations

import asyncio
import random
import time

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.structs import TopicPartition

from app.kafka.client_options import client_options
from app.kafka.metadata import topic_partitions
from app.protocol import CommandEnvelope
from app.settings import Settings


def accounts_commands(n_commands: int, n_accounts: int, seed: int) -> list[CommandEnvelope]:
    """Opens for every account first, then deposits and withdrawals: some withdrawals are
    rejected (insufficient funds) and 2% carry a stale expected version (conflicts)."""
    rng = random.Random(seed)
    ids = [f"acc-{n}" for n in range(n_accounts)]
    commands = [
        CommandEnvelope(f"o-{a}", "accounts", a, "open", {"owner": a}, expect_new=True, submitted_at=0) for a in ids
    ]
    for n in range(max(n_commands - n_accounts, 0)):
        account = rng.choice(ids)
        name = "deposit" if rng.random() < 0.6 else "withdraw"
        stale = 0 if rng.random() < 0.02 else None
        commands.append(
            CommandEnvelope(f"c-{n}", "accounts", account, name, {"amount": rng.randint(1, 100)}, expected_version=stale, submitted_at=0)
        )
    return commands


async def produce(settings: Settings, topic: str, records: list[tuple[bytes, bytes]]) -> float:
    """Produce records (idempotent, acks=all) as fast as aiokafka allows; returns seconds."""
    producer = AIOKafkaProducer(
        **client_options(settings), acks="all", enable_idempotence=True, linger_ms=20, max_batch_size=256 * 1024
    )
    await producer.start()
    try:
        started = time.perf_counter()
        futures = []
        for key, value in records:
            futures.append(await producer.send(topic, value, key=key))
            if len(futures) >= 20_000:
                await asyncio.gather(*futures)
                futures.clear()
        await asyncio.gather(*futures)
        return time.perf_counter() - started
    finally:
        await producer.stop()


async def committed_lag(settings: Settings, group: str, topic: str) -> int:
    """Records of `topic` not yet committed by `group`."""
    admin = AIOKafkaAdminClient(**client_options(settings))
    await admin.start()
    try:
        offsets = await admin.list_consumer_group_offsets(group)
    finally:
        await admin.close()
    consumer = AIOKafkaConsumer(**client_options(settings), group_id=None)
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in await topic_partitions(consumer, topic)]
        ends = await consumer.end_offsets(tps)
    finally:
        await consumer.stop()
    return sum(ends[tp] - (offsets[tp].offset if tp in offsets and offsets[tp].offset >= 0 else 0) for tp in tps)


def command_records(commands: list[CommandEnvelope]) -> list[tuple[bytes, bytes]]:
    return [(c.key, c.encode()) for c in commands]

