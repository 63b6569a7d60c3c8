"""What the API's local copies of topics share: the state replica (the changelog) and the
history index (the events topics).

Each keeps a RocksDB store of its own, fed by a read_committed reader outside any group,
and writes what each fetch brings together with the positions the reader reached in ONE
RocksDB write: a restart resumes exactly there, and a crash never leaves data without its
position or the other way round. A write wakes whoever waits for what it brings.
"""

from __future__ import annotations

import asyncio
import logging
import time
from abc import ABC, abstractmethod
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TypeVar

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.structs import ConsumerRecord

from ..kafka.reader import committed_reader
from ..kafka.stopping import stop_consumer
from ..metrics import STORE_MEMORY
from ..settings import Settings
from ..state.resources import StoreResources
from ..state.store import RocksDBStore

log = logging.getLogger(__name__)
T = TypeVar("T")

Batches = Mapping[TopicPartition, list[ConsumerRecord[bytes, bytes]]]
Offsets = dict[TopicPartition, int]  # the next offset to read of each partition

# Records a fetch may bring, and so one RocksDB write may hold: larger while catching up
# (fewer, larger writes), smaller afterwards, so a write that wakes a waiting request is
# not held up behind thousands of others.
CATCH_UP_RECORDS = 10_000
FOLLOW_RECORDS = 5000
RETRY_S = 5.0  # after following failed (a topic missing, a broker away for long)


class TopicFollower(ABC):
    """A local RocksDB copy of topics, kept up to date by a task of the API's event loop.

    `ready` is set once the copy has caught up with the topics as they were when it
    started following them."""

    def __init__(self, settings: Settings, path: Path, resources: StoreResources, name: str, role: str) -> None:
        self.settings = settings
        self.path = path
        self.resources = resources
        self.name = name  # e.g. "replica": in the client id and the logs
        self.role = role  # the label of its RocksDB memory gauge
        self.store: RocksDBStore | None = None
        self.ready = asyncio.Event()
        self._consumer: AIOKafkaConsumer | None = None
        self._follow: asyncio.Task[None] | None = None
        self._offsets: Offsets = {}
        self._waiters: dict[bytes, list[asyncio.Future[None]]] = defaultdict(list)
        self._moves: set[asyncio.Future[None]] = set()

    # -- what a follower is ----------------------------------------------------------

    @abstractmethod
    async def partitions(self) -> list[TopicPartition]:
        """The partitions to follow."""

    @abstractmethod
    def stored_offsets(self, store: RocksDBStore) -> Offsets:
        """The offsets the store's data reflects, as its last write recorded them."""

    @abstractmethod
    def write(self, store: RocksDBStore, batches: Batches, offsets: Offsets) -> Iterable[bytes]:
        """Write what `batches` bring and `offsets` (the partitions whose position moved)
        in one RocksDB write; the keys written, for the requests waiting on them."""

    def written(self, offsets: Offsets) -> None:  # noqa: B027  # optional: a gauge, say
        """After each write, with the positions that moved."""

    # -- running -----------------------------------------------------------------------

    async def start(self, not_before: asyncio.Event | None = None) -> None:
        """Open the store and start following; with `not_before`, only once that is set."""
        try:
            self.store = RocksDBStore(self.path, self.resources)
        except Exception as error:
            raise RuntimeError(
                f"cannot open the API's {self.name} at {self.path} ({error}); each API instance on a "
                "host needs its own ESK_API__STATE_DIR"
            ) from None
        self._consumer = committed_reader(self.settings, f"{self.settings.app}.api-{self.name}")
        await self._consumer.start()
        self._follow = asyncio.create_task(self._run(not_before), name=self.name)

    async def stop(self) -> None:
        if self._follow is not None:
            self._follow.cancel()
            await asyncio.gather(self._follow, return_exceptions=True)
        if self._consumer is not None:
            await stop_consumer(self._consumer)
        if self.store is not None:
            self.store.close()
            self.store = None

    def offsets(self) -> Offsets:
        """How far the store reflects each partition (written, so readable)."""
        return dict(self._offsets)

    async def _run(self, not_before: asyncio.Event | None) -> None:
        if not_before is not None:
            await not_before.wait()
        while True:
            try:
                await self._follow_partitions()
            except Exception as error:
                # Not fatal to the API: it goes on serving what it has, and tries again.
                log.warning("the API's %s stopped following (%r); again in %.0f s", self.name, error, RETRY_S)
                await asyncio.sleep(RETRY_S)

    async def _follow_partitions(self) -> None:
        assert self._consumer is not None and self.store is not None
        consumer = self._consumer
        tps = await self.partitions()
        if not tps:
            self.ready.set()
            await asyncio.Event().wait()  # nothing to follow, ever: the set of partitions is fixed
        consumer.assign(tps)
        beginnings = await consumer.beginning_offsets(tps)
        ends = await consumer.end_offsets(tps)  # read_committed: the last stable offsets
        stored = self.stored_offsets(self.store)
        stale = sorted(str(tp) for tp in tps if stored.get(tp, 0) > ends[tp])
        if stale:
            # Offsets the topics never had (topics recreated): the store cannot be trusted.
            log.warning("the API's %s is beyond the end of %s; rebuilding it", self.name, ", ".join(stale))
            self.ready.clear()
            self.store.close()
            RocksDBStore.destroy(self.path)
            self.store = RocksDBStore(self.path, self.resources)
            stored = {}
        for tp in tps:
            start = max(stored.get(tp, 0), beginnings[tp])
            consumer.seek(tp, start)
            self._offsets[tp] = start
        self.written(dict(self._offsets))  # every partition from the start, those without events too
        behind = {tp for tp in tps if self._offsets[tp] < ends[tp]}
        started, records = time.monotonic(), 0
        if not behind:
            self._caught_up(records, started)
        while True:
            batches = await consumer.getmany(timeout_ms=1000, max_records=CATCH_UP_RECORDS if behind else FOLLOW_RECORDS)
            # The position moves past transaction markers too, which may come in a fetch of
            # their own, without records: a read waiting for a command's position needs
            # the index to say it is past its commit marker.
            moved: Offsets = {}
            for tp in tps:
                position = await consumer.position(tp)
                if position != self._offsets[tp]:
                    moved[tp] = position
            if not moved:
                continue
            if behind:
                # Catching up is a long run of big writes (a whole history, at an instance's
                # start): in a thread, so the event loop goes on answering commands while
                # it lasts. Afterwards each fetch is small and waited for: written inline.
                keys = await asyncio.to_thread(self.write, self.store, batches, moved)
            else:
                keys = self.write(self.store, batches, moved)
            self._offsets.update(moved)  # only now: whoever sees an offset finds its data
            self._wake(keys)
            self.written(moved)
            STORE_MEMORY.labels(self.role).set(self.resources.usage_bytes())
            if behind:
                records += sum(len(fetched) for fetched in batches.values())
                behind = {tp for tp in behind if self._offsets[tp] < ends[tp]}
                if not behind:
                    self._caught_up(records, started)

    def _caught_up(self, records: int, started: float) -> None:
        if not self.ready.is_set():
            log.info("the API's %s caught up (%d records in %.1f s)", self.name, records, time.monotonic() - started)
        self.ready.set()

    # -- waiting -----------------------------------------------------------------------

    def _wake(self, keys: Iterable[bytes]) -> None:
        if self._waiters:
            for key in keys:
                for waiter in self._waiters.pop(key, ()):
                    _wake(waiter)
        if self._moves:
            moves, self._moves = self._moves, set()
            for waiter in moves:
                _wake(waiter)

    def moved(self) -> asyncio.Future[None]:
        """A future done at the next write; cancel it when no longer waiting."""
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._moves.add(waiter)
        waiter.add_done_callback(self._moves.discard)
        return waiter

    async def _wait(self, key: bytes, lookup: Callable[[], T | None], timeout_s: float) -> T | None:
        """`lookup()` once it is not None, looked up again whenever `key` is written; None
        after `timeout_s`."""
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
