"""The processor: one consumer group on `<app>.commands`, one StreamTask per partition.

All tasks of a process share one asyncio loop, one consumer and one RocksDB memory
budget; each task has its own store and its own transactional producer whose id is
stable per input partition (`<group>.<partition>`). aiokafka speaks the pre-KIP-447
transaction protocol, so that id is what fences a zombie: the next owner's
init_transactions aborts whatever the previous owner left open, and the previous owner's
next transactional request fails with ProducerFenced.

Assignment is ours (StandbyAssignor): sticky, and a partition that must move goes to the
member with the warmest copy of its store. With `standby_replicas`, members keep such
copies (StandbyTasks) of partitions they do not own.

A newly assigned partition is paused until its task is ready (producer initialised,
store restored from the changelog, position set to the one the store's last transaction
recorded, or the group's committed offset if that is further on). Commands for
it wait in Kafka meanwhile; they are neither rejected nor lost.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition
from aiokafka.coordinator.assignors.roundrobin import RoundRobinPartitionAssignor
from aiokafka.errors import ProducerFenced

from ..kafka.client_options import client_options
from ..kafka.reader import committed_reader
from ..kafka.topics import TopicNames
from ..kafka.transactions import transactional_producer
from ..metrics import (
    ACTIVE_TASKS,
    EXPIRED,
    RESTORE_RATE,
    RESTORE_RECORDS,
    RESTORE_REMAINING,
    REVOKE_SECONDS,
    STORE_MEMORY,
)
from .assignor import StandbyAssignor
from .record_collector import MAX_BATCH_BYTES
from .standby import StandbyTasks
from .stream_task import StreamTask
from ..protocol import now_ms, position_key
from ..registry import Registry
from ..settings import Settings
from ..state.resources import StoreResources
from ..state.restore import RestoreProgress, StaleStoreError, restore
from ..state.store import RocksDBStore, open_store

log = logging.getLogger(__name__)

# Commits in flight get a turn every this many commands handled: each commit waits on
# several round trips, and a whole poll's worth of handling before each of them
# stretched a commit to most of a second under a backlog.
YIELD_EVERY = 64


class Processor:
    def __init__(
        self,
        settings: Settings,
        registry: Registry,
        on_restore_progress: Callable[[RestoreProgress], None] | None = None,
    ) -> None:
        self.settings = settings
        self.registry = registry
        self.topics = TopicNames(settings.app)
        self.group_id = settings.processor.group_id or f"{settings.app}.processor"
        self.state_dir = Path(settings.processor.state_dir)
        self.resources = StoreResources(settings.processor.memory_budget_mb)
        self.tasks: dict[int, StreamTask] = {}
        self._starting: dict[int, asyncio.Task[None]] = {}
        self._assigned: set[int] = set()
        # Held while records are handled, and by the rebalance callbacks. A commit runs in
        # the background (one per task at a time, in _commits); revoking a partition waits
        # for its commit in flight (StreamTask.commit and close do).
        self._lock = asyncio.Lock()
        self._commits: dict[int, asyncio.Task[None]] = {}
        self._consumer: AIOKafkaConsumer | None = None
        self._on_restore_progress = on_restore_progress
        self.restores: dict[int, RestoreProgress] = {}
        self._last_expiry = time.monotonic()
        self.standbys = StandbyTasks(settings, self.topics.changelog, self.resources, self.store_path)
        self.assignor = StandbyAssignor(self.topics.commands, settings.processor.standby_replicas, self._warm_copies)

    @property
    def ready(self) -> bool:
        return self._consumer is not None and bool(self._assigned) and self._assigned <= set(self.tasks)

    async def run(self, stop: asyncio.Event) -> None:
        p = self.settings.processor
        consumer = AIOKafkaConsumer(
            **client_options(self.settings),
            group_id=self.group_id,
            client_id=f"{self.group_id}-consumer",
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            isolation_level="read_committed",
            session_timeout_ms=p.session_timeout_ms,
            heartbeat_interval_ms=max(p.session_timeout_ms // 4, 500),
            max_poll_interval_ms=p.max_poll_interval_ms,
            # round robin only while a group still has members of a version without ours
            partition_assignment_strategy=(self.assignor, RoundRobinPartitionAssignor),
        )
        consumer.subscribe([self.topics.commands], listener=_RebalanceListener(self))
        self._consumer = consumer  # the rebalance listener may run inside start()
        standbys_stop = asyncio.Event()
        standbys = None
        if self.settings.processor.standby_replicas > 0:
            standbys = asyncio.create_task(self.standbys.run(standbys_stop), name="standbys")
        await consumer.start()
        try:
            while not stop.is_set():
                await self._poll_once(consumer)
            async with self._lock:
                await self._commit_all()
        finally:
            standbys_stop.set()
            starting = list(self._starting.values())
            for task in starting:
                task.cancel()
            await asyncio.gather(*starting, return_exceptions=True)
            await consumer.stop()
            async with self._lock:
                for partition in list(self.tasks):
                    await self._close_task(partition, commit=False)
            await asyncio.gather(*self._commits.values(), return_exceptions=True)
            if standbys is not None:
                await standbys
            self._consumer = None

    async def _poll_once(self, consumer: AIOKafkaConsumer) -> None:
        batch_max = self.settings.processor.batch_max_records
        # An open batch without a commit in flight is due soon: poll no longer than until then.
        waits = [self._commit_wait(t) for t in self.tasks.values() if t.has_pending and t.partition not in self._commits]
        timeout_ms = round(max(min(waits), 0.0) * 1000) if waits else 200
        batches = await consumer.getmany(timeout_ms=timeout_ms, max_records=batch_max)
        async with self._lock:
            for tp, records in batches.items():
                task = self.tasks.get(tp.partition)
                if task is not None:
                    for start in range(0, len(records), YIELD_EVERY):
                        if start:
                            await asyncio.sleep(0)
                        task.process(records[start:start + YIELD_EVERY])
                    if tp.partition in self._commits and task.pending_commands >= batch_max:
                        consumer.pause(tp)  # a full batch waits for the commit in flight
            self._expire_due()
            for task in self.tasks.values():
                if task.partition not in self._commits and (self._batch_due(task, task.input in batches) or task.group_offset_due()):
                    self._commits[task.partition] = asyncio.create_task(self._commit(task), name=f"commit-{task.partition}")
        STORE_MEMORY.labels("processor").set(self.resources.usage_bytes())

    async def _commit(self, task: StreamTask) -> None:
        """Commit the task's open batch. What it handled meanwhile is the next batch, and is
        committed straight after (once spaced from this one, unless full): batches grow with
        the load, and no command waits for a poll to be committed."""
        try:
            while task.has_pending or task.group_offset_due():
                wait = self._commit_wait(task)
                if wait > 0:
                    await asyncio.sleep(wait)
                await task.commit()
        except Exception as error:
            async with self._lock:
                if self.tasks.get(task.partition) is task:
                    await self._fail_task(task, error)
        finally:
            if self._commits.get(task.partition) is asyncio.current_task():
                del self._commits[task.partition]
            if self.tasks.get(task.partition) is task and self._consumer is not None:
                self._consumer.resume(task.input)

    def _batch_due(self, task: StreamTask, still_fetching: bool) -> bool:
        """The open batch is to be committed now: it may be (`_commit_wait`), and it is full,
        or nothing more came for it, or it is as old as a batch may get."""
        if not task.has_pending or self._commit_wait(task) > 0:
            return False
        p = self.settings.processor
        return task.pending_commands >= p.batch_max_records or not still_fetching or task.batch_age() >= p.commit_interval_ms / 1000

    def _commit_wait(self, task: StreamTask) -> float:
        """Seconds until the task may begin its next transaction: `commit_spacing_ms` after
        the last one began, or now if its open batch is full."""
        if task.pending_commands >= self.settings.processor.batch_max_records:
            return 0.0
        return task.last_commit_started + self.settings.processor.commit_spacing_ms / 1000 - time.monotonic()

    async def _commit_all(self) -> None:
        """At shutdown: every open batch, each after its task's commit in flight."""
        tasks = list(self.tasks.values())
        results = await asyncio.gather(*(t.commit(final=True) for t in tasks), return_exceptions=True)
        for task, result in zip(tasks, results):
            if isinstance(result, BaseException):
                log.warning("partition %d: last commit failed (%r); the next owner redoes it", task.partition, result)

    def _expire_due(self) -> None:
        now = time.monotonic()
        if now - self._last_expiry < self.settings.processor.expiry_interval_s:
            return
        self._last_expiry = now
        for task in self.tasks.values():
            expired = task.expire(now_ms(), self.settings.processor.expiry_batch)
            if expired:
                EXPIRED.inc(expired)

    async def _fail_task(self, task: StreamTask, error: BaseException) -> None:
        """A failed commit leaves nothing behind (the transaction aborts or is fenced, RocksDB
        was not written); drop the task and, if the partition is still ours, start afresh
        from the committed offset."""
        assert self._consumer is not None
        self._consumer.pause(task.input)
        await self._close_task(task.partition, commit=False)
        if isinstance(error, ProducerFenced):
            log.warning("partition %d: fenced by a newer owner; giving it up", task.partition)
            self._assigned.discard(task.partition)
            return
        log.error("partition %d: commit failed (%r); restarting its task", task.partition, error)
        if task.partition in self._assigned:
            self._start(task.partition)

    # -- assignment ----------------------------------------------------------------

    def store_path(self, partition: int) -> Path:
        return self.state_dir / f"{self.topics.commands}-{partition}"

    def _warm_copies(self) -> dict[int, int]:
        """What this member tells the group leader it has: its standby copies with their
        changelog offsets, and any other store left on disk (offset unknown: 0)."""
        prefix = f"{self.topics.commands}-"
        on_disk = {
            int(path.name[len(prefix):]): 0
            for path in (self.state_dir.iterdir() if self.state_dir.is_dir() else ())
            if path.name.startswith(prefix) and path.name[len(prefix):].isdigit()
        }
        return on_disk | self.standbys.offsets()

    async def _on_assigned(self, assigned: set[TopicPartition]) -> None:
        assert self._consumer is not None
        # Standby copies that turned active are closed first: the active task opens the same store.
        await self.standbys.assign(self.assignor.standby - {tp.partition for tp in assigned})
        for tp in assigned:
            self._assigned.add(tp.partition)
            if tp.partition not in self.tasks and tp.partition not in self._starting:
                self._consumer.pause(tp)
                self._start(tp.partition)

    async def _on_revoked(self, revoked: set[TopicPartition]) -> None:
        started = time.monotonic()
        async with self._lock:
            for tp in revoked:
                self._assigned.discard(tp.partition)
                starting = self._starting.pop(tp.partition, None)
                if starting is not None:
                    starting.cancel()
                if tp.partition in self.tasks:
                    await self._close_task(tp.partition, commit=True)
        elapsed = time.monotonic() - started
        REVOKE_SECONDS.observe(elapsed)
        if revoked:
            log.info("gave up partitions %s in %.3fs", sorted(tp.partition for tp in revoked), elapsed)

    def _start(self, partition: int) -> None:
        self._starting[partition] = asyncio.create_task(self._start_task(partition), name=f"start-{partition}")

    async def _start_task(self, partition: int) -> None:
        tp = TopicPartition(self.topics.commands, partition)
        attempt = 0
        while True:
            try:
                task = await self._build_task(partition)
                break
            except asyncio.CancelledError:
                raise
            except Exception:
                attempt += 1
                log.exception("partition %d: could not start its task (attempt %d)", partition, attempt)
                await asyncio.sleep(min(0.5 * attempt, 5.0))
        async with self._lock:
            self._starting.pop(partition, None)
            if partition not in self._assigned or self._consumer is None:
                await task.close()
                return
            self.tasks[partition] = task
            self._consumer.seek(tp, task.next_offset)
            self._consumer.resume(tp)
            ACTIVE_TASKS.set(len(self.tasks))
        log.info("partition %d: ready at offset %d", partition, task.next_offset)

    async def _build_task(self, partition: int) -> StreamTask:
        assert self._consumer is not None
        producer = transactional_producer(
            self.settings, f"{self.group_id}.{partition}", MAX_BATCH_BYTES, client_id=f"{self.group_id}-{partition}"
        )
        store = None
        try:
            # init_transactions (inside start) fences the previous owner and aborts its open
            # transaction, so the changelog we restore next can no longer change under us.
            await producer.start()
            store = await self._open_restored_store(partition)
            tp = TopicPartition(self.topics.commands, partition)
            committed = await self._consumer.committed(tp)
            stored = store.get(position_key(partition))
            start = max(
                committed if committed is not None else (await self._consumer.beginning_offsets([tp]))[tp],
                int(stored) if stored is not None else 0,
            )
            return StreamTask(
                partition,
                self.topics,
                self.registry,
                store,
                producer,
                self.group_id,
                start,
                committed,
                dedup_window_ms=self.settings.processor.dedup_window_s * 1000,
                group_offset_interval_s=self.settings.processor.group_offset_interval_ms / 1000,
            )
        except BaseException:
            if store is not None:
                store.close()
            await producer.stop()
            raise

    async def _open_restored_store(self, partition: int) -> RocksDBStore:
        path = self.store_path(partition)
        store = await open_store(path, self.resources)
        reader = committed_reader(self.settings, f"{self.group_id}-restore-{partition}")
        await reader.start()
        try:
            try:
                progress = await restore(reader, store, self.topics.changelog, [partition], self._progress, expiry_index=True)
            except StaleStoreError as error:
                log.warning("partition %d: %s; rebuilding the store", partition, error)
                store.close()
                RocksDBStore.destroy(path)
                store = await open_store(path, self.resources)
                progress = await restore(reader, store, self.topics.changelog, [partition], self._progress, expiry_index=True)
            self.restores[partition] = progress[partition]
            RESTORE_RECORDS.labels("processor").inc(progress[partition].restored)
            return store
        except BaseException:
            store.close()
            raise
        finally:
            await reader.stop()

    def _progress(self, progress: RestoreProgress) -> None:
        self.restores[progress.partition] = progress
        labels = ("processor", str(progress.partition))
        RESTORE_REMAINING.labels(*labels).set(max(progress.total - progress.restored, 0))
        RESTORE_RATE.labels(*labels).set(progress.rate)
        if self._on_restore_progress is not None:
            self._on_restore_progress(progress)

    async def _close_task(self, partition: int, commit: bool) -> None:
        task = self.tasks.pop(partition, None)
        ACTIVE_TASKS.set(len(self.tasks))
        if task is None:
            return
        if commit:
            try:
                await task.commit(final=True)  # after the commit in flight, if any
            except Exception as error:  # fenced or failed: the next owner redoes the batch
                log.warning("partition %d: final commit failed (%r); the next owner redoes it", partition, error)
        await task.close()


class _RebalanceListener(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, processor: Processor) -> None:
        self.processor = processor

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        await self.processor._on_revoked(revoked)

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        await self.processor._on_assigned(assigned)
