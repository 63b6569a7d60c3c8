"""G5 with the real broker: a clean restart replays nothing; a lost store, or one left
behind by a crash between the Kafka commit and the RocksDB write, is restored."""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from esk.settings import Settings
from esk.state.store import RocksDBStore
from tests.system import events_topic, processor, read_topic, system, with_state_dirs

pytestmark = pytest.mark.kafka


async def _deposits(client, accounts: list[str], rounds: int) -> None:  # type: ignore[no-untyped-def]
    for account in accounts:
        r = await client.post(f"/v1/accounts/{account}/open", json={"owner": "o"})
        assert r.status_code in (200, 409)
    for _ in range(rounds):
        for account in accounts:
            r = await client.post(f"/v1/accounts/{account}/deposit", json={"amount": 1})
            assert r.status_code == 200, r.text


async def test_clean_restart_replays_nothing_and_a_lost_store_is_rebuilt(settings: Settings) -> None:
    accounts = [f"a{n}-{uuid.uuid4().hex[:4]}" for n in range(12)]
    own = with_state_dirs(settings, "p0")
    async with system(settings, processors=0) as s:
        async with processor(own, s.registry) as first:
            await _deposits(s.client, accounts, 3)
        assert sum(p.restored for p in first.processor.restores.values()) == 0  # a new, empty changelog

        async with processor(own, s.registry) as clean:
            r = await s.client.post(f"/v1/accounts/{accounts[0]}/deposit", json={"amount": 1})
            assert r.json()["version"] == 5
        assert {p: r.restored for p, r in clean.processor.restores.items()} == {
            p: 0 for p in range(settings.topics.partitions)
        }

        shutil.rmtree(own.processor.state_dir)
        async with processor(own, s.registry) as rebuilt:
            r = await s.client.post(f"/v1/accounts/{accounts[1]}/deposit", json={"amount": 1})
            assert r.status_code == 200 and r.json()["version"] == 5
            restored = sum(p.restored for p in rebuilt.processor.restores.values())
            # every account's state and every command's outcome came back from the changelog
            assert restored >= 2 * len(accounts) + 4 * len(accounts)
            # and nothing is left to restore, the transaction markers between the records too
            # (an alert fires on a restore that does not get to 0)
            assert {
                p: REGISTRY.get_sample_value("esk_restore_remaining_records", {"role": "processor", "partition": str(p)})
                for p in rebuilt.processor.restores
            } == dict.fromkeys(rebuilt.processor.restores, 0.0)
        for account in accounts:
            r = await s.client.get(f"/v1/accounts/{account}")
            assert r.json()["state"]["balance"] == (4 if account in accounts[:2] else 3)


async def test_a_crash_between_commit_and_rocksdb_write_is_repaired_on_restart(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    accounts = [f"a{n}-{uuid.uuid4().hex[:4]}" for n in range(6)]
    own = with_state_dirs(settings, "p0")
    async with system(settings, processors=0) as s:
        async with processor(own, s.registry):
            await _deposits(s.client, accounts, 1)
        # The next processor commits each account's deposit to Kafka, then "dies" before
        # its RocksDB write (each account is touched once, so nothing reads the stale store).
        monkeypatch.setattr(RocksDBStore, "write", _lose_processor_writes(own.processor.state_dir))
        async with processor(own, s.registry):
            for account in accounts:
                r = await s.client.post(f"/v1/accounts/{account}/deposit", json={"amount": 1})
                assert r.status_code == 200 and r.json()["version"] == 3
        monkeypatch.undo()
        async with processor(own, s.registry) as repaired:
            assert sum(p.restored for p in repaired.processor.restores.values()) >= 2 * len(accounts)
            for account in accounts:
                r = await s.client.post(f"/v1/accounts/{account}/withdraw", json={"amount": 2})
                assert r.status_code == 200 and r.json()["version"] == 4, r.text
    history = [v for k, v, _ in await read_topic(settings, events_topic(settings, "accounts"))]
    for account in accounts:
        versions = [e["version"] for e in history if e["aggregate_id"] == account]
        assert versions == [1, 2, 3, 4]


_real_write = RocksDBStore.write


def _lose_processor_writes(state_dir: Path) -> Callable[..., None]:
    """Stands in for a process that died right after commit_transaction returned: the
    batch never reaches the processor's RocksDB (the API replicas write as usual)."""

    def write(self: RocksDBStore, updates: Mapping[bytes, bytes | None], offsets: Mapping[int, int]) -> None:
        if Path(self.path).is_relative_to(state_dir):
            return
        _real_write(self, updates, offsets)

    return write
