"""TTL that the changelog agrees with: expiry writes tombstones, so neither a restore nor
an API replica resurrects what expired."""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
import uuid
from datetime import timedelta

import pytest

from domain.accounts import accounts
from domain.orders import orders
from esk.kafka.reader import read_committed
from esk.kafka.topics import TopicNames, ensure_topics, topic_specs
from esk.protocol import aggregate_key, command_key
from esk.settings import Settings
from tests.system import api, processor, with_state_dirs

pytestmark = pytest.mark.kafka


async def test_closed_accounts_and_old_command_ids_expire_through_the_changelog(settings: Settings) -> None:
    registry = {"accounts": dataclasses.replace(accounts, retention=timedelta(seconds=1)), "orders": orders}
    quick = settings.model_copy(
        update={"processor": settings.processor.model_copy(update={"dedup_window_s": 2, "expiry_interval_s": 0.2})}
    )
    await ensure_topics(quick, topic_specs(quick, registry))
    own = with_state_dirs(quick, "p0")
    closed, kept = f"closed-{uuid.uuid4().hex[:6]}", f"kept-{uuid.uuid4().hex[:6]}"
    async with api(with_state_dirs(quick, "a0"), registry) as client:
        async with processor(own, registry) as running:
            for account in (closed, kept):
                r = await client.post(f"/v1/accounts/{account}/open", json={"owner": "o"}, headers={"Idempotency-Key": f"open-{account}"})
                assert r.status_code == 200
            r = await client.post(f"/v1/accounts/{closed}/close", json={})
            assert r.status_code == 200 and r.json()["version"] == 2

            for _ in range(100):  # retention 1 s, de-duplication window 2 s, sweep every 0.2 s
                gone = (await client.get(f"/v1/accounts/{closed}")).status_code == 404
                forgotten = (await client.get(f"/v1/commands/open-{kept}")).status_code == 404
                if gone and forgotten:
                    break
                await asyncio.sleep(0.1)
            assert gone and forgotten
            assert (await client.get(f"/v1/accounts/{kept}")).status_code == 200  # open accounts never expire
            r = await client.post(f"/v1/accounts/{closed}/deposit", json={"amount": 1})
            assert r.status_code == 404 and r.json()["code"] == "not_found"
            partition_stores = [t.store for t in running.processor.tasks.values()]
            assert all(s.get(aggregate_key("accounts", closed)) is None for s in partition_stores)

        changelog = {r.key: r.value for r in await read_committed(quick, TopicNames(quick.app).changelog)}
        assert changelog[aggregate_key("accounts", closed)] is None  # a tombstone: latest value per key
        assert changelog[command_key(f"open-{kept}")] is None
        assert changelog[aggregate_key("accounts", kept)] is not None

        # The store's expiry index is local: its entries come back from the changelog
        # records' headers. A command remembered just before the store is lost is still
        # forgotten on time by the rebuilt store.
        async with processor(own, registry):
            r = await client.post(f"/v1/accounts/{kept}/deposit", json={"amount": 5}, headers={"Idempotency-Key": f"late-{kept}"})
            assert r.status_code == 200 and r.json()["version"] == 2
        assert not any(key.startswith(b"x/") for key in changelog)

        # A wiped store is rebuilt without what expired.
        shutil.rmtree(own.processor.state_dir)
        async with processor(own, registry):
            assert (await client.get(f"/v1/accounts/{closed}")).status_code == 404
            r = await client.post(f"/v1/accounts/{kept}/deposit", json={"amount": 5})
            assert r.status_code == 200 and r.json()["version"] == 3
            for _ in range(100):
                if (await client.get(f"/v1/commands/late-{kept}")).status_code == 404:
                    break
                await asyncio.sleep(0.1)
            assert (await client.get(f"/v1/commands/late-{kept}")).status_code == 404
