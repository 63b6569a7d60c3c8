"""G1-G3, G6 and G8 against the real broker: ordering, optimistic versions, exactly-once
effect across two API instances and two processors, aborted transactions, the DLQ."""

from __future__ import annotations

import asyncio
import random
import uuid
from collections import defaultdict

import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError

from domain.accounts import accounts
from esk.kafka.topics import TopicNames
from esk.protocol import CommandEnvelope, aggregate_key
from esk.settings import Settings
from tests.system import events_topic, read_topic, system, wait_for

pytestmark = pytest.mark.kafka


async def test_concurrent_commands_through_two_apis_and_two_processors(settings: Settings) -> None:
    rng = random.Random(7)
    async with system(settings, apis=2, processors=2) as s:
        ids = [f"acc-{n}-{uuid.uuid4().hex[:6]}" for n in range(8)]
        for account in ids:
            r = await s.clients[0].post(f"/v1/accounts/{account}/open", json={"owner": account})
            assert r.status_code == 200

        async def one(n: int) -> tuple[str, int, dict[str, object]]:
            account = rng.choice(ids)
            client = s.clients[n % 2]
            command, amount = rng.choice([("deposit", rng.randint(1, 50)), ("withdraw", rng.randint(1, 80))])
            headers = {}
            if n % 5 == 0:  # some commands carry an expected version, which races
                current = (await client.get(f"/v1/accounts/{account}")).json()["version"]
                headers["If-Match"] = f'"{current}"'
            r = await client.post(f"/v1/accounts/{account}/{command}", json={"amount": amount}, headers=headers)
            return account, r.status_code, r.json()

        results = await asyncio.gather(*(one(n) for n in range(240)))
        statuses = defaultdict(int)
        for _, status, _ in results:
            statuses[status] += 1
        assert set(statuses) <= {200, 412, 422}, statuses
        assert statuses[200] > 100

        events = await read_topic(settings, events_topic(settings, "accounts"))
        by_account: dict[str, list[dict[str, object]]] = defaultdict(list)
        for key, value, headers in events:
            by_account[key.decode()].append(value)
            assert headers["esk-event-type"].decode() == value["type"]
        for account in ids:
            history = by_account[account]
            # G1/G3: versions 1..n, no gap, no duplicate
            assert [e["version"] for e in history] == list(range(1, len(history) + 1))
            folded = accounts.fold(accounts.decode_event(e["type"], e["schema_version"], e["data"]) for e in history)
            for client in s.clients:  # read-your-writes from either instance
                r = await client.get(f"/v1/accounts/{account}?min_version={len(history)}")
                assert r.status_code == 200
                assert r.json()["version"] == len(history)
                assert r.json()["state"] == folded.model_dump()
                assert folded.balance >= 0
        accepted_events = sum(len(body["events"]) for _, status, body in results if status == 200)
        assert accepted_events + len(ids) == len(events)  # every accepted command's events, exactly once
        for _, status, body in results:
            if status == 412:
                assert body["current_version"] >= 1


async def test_an_aborted_transaction_leaves_no_trace(settings: Settings) -> None:
    """A processor killed mid-batch: its transaction was open, with events and changelog
    records sent. The next owner's producer fences it and the transaction aborts."""
    names = TopicNames(settings.app)
    account = f"acc-{uuid.uuid4().hex[:6]}"
    async with system(settings) as s:
        r = await s.client.post(f"/v1/accounts/{account}/open", json={"owner": "ada"})
        assert r.status_code == 200
    changelog = await read_topic(settings, names.changelog)
    assert any(k == aggregate_key("accounts", account) for k, _, _ in changelog)

    zombie = AIOKafkaProducer(
        bootstrap_servers=settings.bootstrap_servers,
        transactional_id=f"{settings.app}.processor.0",
        enable_idempotence=True,
    )
    await zombie.start()
    await zombie.begin_transaction()
    await zombie.send_and_wait(names.events("accounts"), b'{"type":"Deposited","version":2}', key=account.encode())
    await zombie.send_and_wait(names.changelog, b'{"version":99,"state":{},"updated_at":0}', key=aggregate_key("accounts", account), partition=0)
    # ... and the zombie dies without committing or aborting.

    async with system(settings) as s:
        r = await s.client.get(f"/v1/accounts/{account}")
        assert r.json()["version"] == 1
        r = await s.client.post(f"/v1/accounts/{account}/deposit", json={"amount": 5})
        assert r.status_code == 200 and r.json()["version"] == 2
        events = [v for k, v, _ in await read_topic(settings, names.events("accounts")) if k == account.encode()]
        assert [(e["type"], e["version"]) for e in events] == [("Opened", 1), ("Deposited", 2)]
        assert all(not isinstance(v, dict) or v.get("version") != 99 for _, v, _ in await read_topic(settings, names.changelog))
    with pytest.raises(KafkaError):  # the zombie is fenced (or its transaction was aborted)
        await zombie.commit_transaction()
    await zombie.stop()


async def test_undecodable_records_go_to_the_dlq_and_the_partition_moves_on(settings: Settings) -> None:
    names = TopicNames(settings.app)
    async with system(settings) as s:
        producer = AIOKafkaProducer(bootstrap_servers=settings.bootstrap_servers, acks="all")
        await producer.start()
        try:
            for partition in range(settings.topics.partitions):
                await producer.send_and_wait(names.commands, b"\xff not json", key=b"junk", partition=partition)
                await producer.send_and_wait(names.commands, b'{"command_id": 5}', key=b"junk", partition=partition)
            wrong_key = CommandEnvelope("c-wrong", "accounts", "a1", "open", {"owner": "x"})
            await producer.send_and_wait(names.commands, wrong_key.encode(), key=b"accounts/other")
        finally:
            await producer.stop()
        account = f"acc-{uuid.uuid4().hex[:6]}"
        r = await s.client.post(f"/v1/accounts/{account}/open", json={"owner": "ada"})
        assert r.status_code == 200
        dlq: list[object] = []

        async def collect() -> None:
            dlq[:] = await read_topic(settings, names.dlq, decode=False)

        for _ in range(100):
            await collect()
            if len(dlq) >= 2 * settings.topics.partitions + 1:
                break
            await asyncio.sleep(0.1)
        reasons = [h["esk-dlq-reason"].decode() for _, _, h in dlq]  # type: ignore[misc]
        assert len(reasons) == 2 * settings.topics.partitions + 1
        assert sum("not JSON" in r for r in reasons) == settings.topics.partitions
        assert sum("does not match" in r for r in reasons) == 1
        # the partitions kept moving: every processor task is past the junk
        await wait_for(
            lambda: sum(t.committed_offset for t in s.processors[0].processor.tasks.values())
            >= 2 * settings.topics.partitions + 2,
            what="offsets past the junk",
        )
