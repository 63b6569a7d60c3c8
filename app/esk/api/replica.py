"""Every API instance keeps a local replica of all state stores, fed by the changelog.

It answers GET requests, waits for command outcomes (the `c/<command_id>` records) and
gives read-your-writes from ANY instance: the changelog records of a command commit in
the same transaction as its events, so once one instance saw an outcome, every instance
will see the version it reports.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from aiokafka import AIOKafkaConsumer, TopicPartition

from ..kafka.metadata import topic_partitions
from ..kafka.reader import committed_reader
from ..kafka.topics import TopicNames
from ..metrics import STORE_MEMORY
from ..protocol import Outcome, StoredAggregate, aggregate_key, command_key
from ..settings import Settings
from ..state.resources import StoreResources
from ..state.restore import changelog_updates, restore
from ..state.store import RocksDBStore

log = logging.getLogger(__name__)
T = TypeVar("T")


class StateReplica:
    def __init__(self, settings: Settings, memory_budget_mb: int = 128) -> None:
        self.settings = settings
        self.topic = TopicNames(settings.app).changelog
        self.path = Path(settings.api.state_dir) / f"{settings.app}.replica"
        self.resources = StoreResources(memory_budget_mb)
        self.store: RocksDBStore | None = None
        self.ready = asyncio.Event()
        self._consumer: AIOKafkaConsumer | None = None
        self._follow: asyncio.Task[None] | None = None
        self._waiters: dict[bytes, list[asyncio.Future[None]]] = defaultdict(list)

    async def start(self) -> None:
        try:
            self.store = RocksDBStore(self.path, self.resources)
        except Exception as error:
            raise RuntimeError(
                f"cannot open the API replica at {self.path} ({error}); each API instance on a "
                "host needs its own ESK_API__STATE_DIR"
            ) from None
        self._consumer = committed_reader(self.settings, f"{self.settings.app}.api-replica")
        await self._consumer.start()
        self._follow = asyncio.create_task(self._run(), name="replica")

    async def stop(self) -> None:
        if self._follow is not None:
            self._follow.cancel()
            await asyncio.gather(self._follow, return_exceptions=True)
        if self._consumer is not None:
            await self._consumer.stop()
        if self.store is not None:
            self.store.close()
            self.store = None

    async def _run(self) -> None:
        assert self._consumer is not None and self.store is not None
        consumer, store = self._consumer, self.store
        partitions = await topic_partitions(self.settings, self.topic)
        await restore(consumer, store, self.topic, partitions)
        self.ready.set()
        log.info("replica of %s caught up", self.topic)
        tps = [TopicPartition(self.topic, p) for p in partitions]
        while True:
            batches = await consumer.getmany(timeout_ms=1000, max_records=5000)
            if not batches:
                continue
            updates = changelog_updates(batches)
            store.write(updates, {tp.partition: await consumer.position(tp) for tp in tps})
            for key in updates:
                for waiter in self._waiters.pop(key, ()):
                    _wake(waiter)
            STORE_MEMORY.labels("api").set(self.resources.usage_bytes())

    # -- reads -------------------------------------------------------------------

    def aggregate(self, aggregate_type: str, aggregate_id: str) -> StoredAggregate | None:
        raw = self.store.get(aggregate_key(aggregate_type, aggregate_id)) if self.store else None
        return StoredAggregate.decode(raw) if raw is not None else None

    def outcome(self, command_id: str) -> Outcome | None:
        raw = self.store.get(command_key(command_id)) if self.store else None
        return Outcome.decode(raw) if raw is not None else None

    async def wait_outcome(self, command_id: str, timeout_s: float) -> Outcome | None:
        return await self._wait(command_key(command_id), lambda: self.outcome(command_id), timeout_s)

    async def wait_version(
        self, aggregate_type: str, aggregate_id: str, min_version: int, timeout_s: float
    ) -> StoredAggregate | None:
        def current() -> StoredAggregate | None:
            found = self.aggregate(aggregate_type, aggregate_id)
            return found if found is not None and found.version >= min_version else None

        await self._wait(aggregate_key(aggregate_type, aggregate_id), current, timeout_s)
        return self.aggregate(aggregate_type, aggregate_id)

    async def _wait(self, key: bytes, lookup: Callable[[], T | None], timeout_s: float) -> T | None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            # Register before looking, so a record applied in between still wakes us.
            waiter: asyncio.Future[None] = loop.create_future()
            self._waiters[key].append(waiter)
            try:
                found = lookup()
                if found is not None:
                    return found
                remaining = deadline - loop.time()
                if remaining <= 0:
                    return None
                # A timer on the future itself: asyncio.wait_for costs several times more
                # per wait, and every command the API takes in waits here once.
                timer = loop.call_later(remaining, _wake, waiter)
                try:
                    await waiter
                finally:
                    timer.cancel()
            finally:
                waiters = self._waiters.get(key)
                if waiters and waiter in waiters:
                    waiters.remove(waiter)
                    if not waiters:
                        del self._waiters[key]


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)
