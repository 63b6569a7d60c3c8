"""The workloads: accounts commands (W1, W2) and orders commands (W4, W6), written straight onto
the commands topic or sent over HTTP (bench/http_load.py)."""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections.abc import Iterator

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.structs import TopicPartition

from esk.kafka.client_options import client_options
from esk.kafka.metadata import topic_partitions
from esk.protocol import CommandEnvelope
from esk.settings import Settings


def account_ids(n_accounts: int) -> list[str]:
    return [f"acc-{n}" for n in range(n_accounts)]


def account_opens(ids: list[str]) -> list[CommandEnvelope]:
    return [CommandEnvelope(f"o-{a}", "accounts", a, "open", {"owner": a}, expect_new=True, submitted_at=0) for a in ids]


def account_moves(ids: list[str], seed: int, id_prefix: str = "c") -> Iterator[CommandEnvelope]:
    """Deposits and withdrawals on random accounts, without end: some withdrawals are
    rejected (insufficient funds) and 2% carry a stale expected version (conflicts)."""
    rng = random.Random(seed)
    for n in itertools.count():
        account = rng.choice(ids)
        name = "deposit" if rng.random() < 0.6 else "withdraw"
        stale = 0 if rng.random() < 0.02 else None
        yield CommandEnvelope(
            f"{id_prefix}-{n}", "accounts", account, name, {"amount": rng.randint(1, 100)}, expected_version=stale, submitted_at=0
        )


PROBES = 24  # new commands that time a restart (W3): a few per partition


def probe_records(ids: list[str], tag: str) -> list[tuple[bytes, bytes]]:
    """`PROBES` deposits on accounts spread over `ids`, with command ids of their own."""
    step = max(len(ids) // PROBES, 1)
    return command_records([CommandEnvelope(f"probe-{tag.replace(' ', '-')}-{n}", "accounts", a, "deposit", {"amount": 1}, submitted_at=0)
                            for n, a in enumerate(ids[::step][:PROBES])])


def accounts_commands(n_commands: int, n_accounts: int, seed: int) -> list[CommandEnvelope]:
    """The W1 workload: opens for every account first, then deposits and withdrawals."""
    ids = account_ids(n_accounts)
    return account_opens(ids) + list(itertools.islice(account_moves(ids, seed), max(n_commands - n_accounts, 0)))


def order_place(order_id: str, customer_id: str, rng: random.Random, pay_from_share: float = 0.0) -> CommandEnvelope:
    """An order of 1-3 lines; `pay_from_share` of them name an account to pay from (one of
    `account_ids(PAYING_ACCOUNTS)`), for the `payments` saga."""
    lines = [{"sku": f"sku-{rng.randrange(1000)}", "qty": rng.randint(1, 3), "price": rng.randint(100, 9_000)}
             for _ in range(rng.randint(1, 3))]
    payload: dict[str, object] = {"customer_id": customer_id, "lines": lines}
    if pay_from_share and rng.random() < pay_from_share:
        payload["pay_from"] = f"acc-{rng.randrange(PAYING_ACCOUNTS)}"
    return CommandEnvelope(f"{order_id}/place", "orders", order_id, "place", payload, expect_new=True, submitted_at=0)


PAYING_ACCOUNTS = 1_000


# What may follow a place; every sequence is accepted, so each command makes one event.
_ORDER_FOLLOW_UPS: tuple[tuple[str, ...], ...] = ((), ("add-line",), ("add-line", "ship"), ("ship",), ("cancel",))


def customers_for(n_events: int) -> int:
    """About 20 orders per customer (an order makes about 2 events): some customers pass
    the read model's 30 orders and get trimmed."""
    return max(n_events // 40, 1)


def orders_commands(n_events: int, seed: int, pay_from_share: float = 0.0) -> list[CommandEnvelope]:
    """Orders placed by `customers_for(n_events)` customers, most followed by add-line,
    ship or cancel: `n_events` commands that make `n_events` events."""
    rng = random.Random(seed)
    customers = customers_for(n_events)
    commands: list[CommandEnvelope] = []
    for n in itertools.count():
        order = f"ord-{n}"
        commands.append(order_place(order, f"cust-{rng.randrange(customers)}", rng, pay_from_share))
        for name in rng.choice(_ORDER_FOLLOW_UPS):
            payload = {"sku": "extra", "qty": 1, "price": rng.randint(100, 900)} if name == "add-line" else {}
            commands.append(CommandEnvelope(f"{order}/{name}", "orders", order, name, payload, submitted_at=0))
        if len(commands) >= n_events:
            return commands[:n_events]
    raise AssertionError("unreachable")


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


async def end_offsets(settings: Settings, topic: str) -> dict[TopicPartition, int]:
    consumer = AIOKafkaConsumer(**client_options(settings), group_id=None)
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in await topic_partitions(settings, topic)]
        ends: dict[TopicPartition, int] = await consumer.end_offsets(tps)
        return ends
    finally:
        await consumer.stop()


async def committed_lag(settings: Settings, group: str, topic: str) -> int:
    """Records of `topic` not yet committed by `group`."""
    admin = AIOKafkaAdminClient(**client_options(settings))
    await admin.start()
    try:
        offsets = await admin.list_consumer_group_offsets(group)
    finally:
        await admin.close()
    ends = await end_offsets(settings, topic)
    return sum(end - (offsets[tp].offset if tp in offsets and offsets[tp].offset >= 0 else 0) for tp, end in ends.items())


def command_records(commands: list[CommandEnvelope]) -> list[tuple[bytes, bytes]]:
    return [(c.key, c.encode()) for c in commands]

