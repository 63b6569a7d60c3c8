"""TaskManager: the lifecycle of every commands partition this processor owns.

Each assigned partition is one `Partition` with one explicit state:

    STARTING  its producer fences the previous owner (init_transactions), then its store is
              restored from the changelog; the partition is paused, its commands wait in Kafka
    REBUILDING  states that an older state model wrote are folded again from their events
              and written through the changelog (state_rebuild.py); still paused
    RUNNING   its StreamTask handles commands; its batches commit in the background, one
              transaction at a time, paced by `commit_spacing_ms`
    CLOSED    revoked, fenced or failed: its producer and store are closed

A partition whose commit fails is CLOSED and, while it is still assigned here, started
afresh from the committed position (the batch handled on top of the failed one is dropped
with it: it read the failed one's writes). A fenced one is given up: a newer owner has it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import ProducerFenced
from aiokafka.structs import ConsumerRecord

from ..kafka.acls import AUTHORIZATION_REFUSED
from ..kafka.reader import committed_reader, transaction_watch
from ..kafka.stopping import stop_consumer
from ..kafka.topics import TopicNames
from ..metrics import (
    ACTIVE_TASKS,
    COMMANDS_LAG,
    COMMIT_SECONDS,
    EXPIRED,
    RESTORE_RATE,
    RESTORE_RECORDS,
    RESTORE_REMAINING,
    TRANSACTION_RECORDS,
)
from ..protocol import now_ms, position_key
from ..registry import Registry
from ..settings import Settings
from ..state.directory import StateDirectory
from ..state.resources import StoreResources
from ..state.restore import RestoreProgress, StaleStoreError, restore
from ..state.store import RocksDBStore, open_store
from .state_rebuild import rebuild_stale_states
from .stream_task import StreamTask
from .streams_producer import StreamsProducer

log = logging.getLogger(__name__)

# Commits in flight get a turn every this many commands handled: each commit waits on
# several round trips, and a whole poll's worth of handling before each of them
# stretched a commit to most of a second under a backlog.
YIELD_EVERY = 64

# A transaction open on a changelog partition after its owner changed: looked at again this
# often, told in an ERROR once it has lasted this long (a marker replicating takes far
# less), and again at this interval.
CHANGELOG_SETTLE_POLL_S = 0.5
CHANGELOG_SETTLE_WARN_S = 10.0
CHANGELOG_SETTLE_REPEAT_S = 60.0


class PartitionState(Enum):
    STARTING = "starting"
    REBUILDING = "rebuilding"
    RUNNING = "running"
    CLOSED = "closed"


@dataclass(eq=False)
class Partition:
    """One assigned commands partition: its task, its producer, and how its commits are paced."""

    number: int
    group_id: str
    state: PartitionState = PartitionState.STARTING
    task: StreamTask | None = None
    producer: StreamsProducer | None = None
    group_offset: int | None = None  # the consumer group's committed offset (None: none yet)
    group_offset_interval_s: float = 1.0
    last_commit_started: float = -math.inf  # monotonic time its last transaction began
    committing: asyncio.Task[None] | None = None  # the commit loop in flight
    failure: BaseException | None = None  # what closed it, a commit having failed
    _group_offset_due_at: float = field(default=0.0)
    _commit_lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def __post_init__(self) -> None:
        self._group_offset_due_at = time.monotonic() + self.group_offset_interval_s

    @property
    def running(self) -> StreamTask:
        """The task, which only a RUNNING partition may use."""
        if self.task is None or self.state is not PartitionState.RUNNING:
            raise RuntimeError(f"partition {self.number} is {self.state.value}")
        return self.task

    def group_offset_due(self) -> bool:
        """The group's offset is behind and due to be committed: even with no command
        pending, so that an idle partition's lag goes down to zero."""
        task = self.task
        return task is not None and self.group_offset != task.committed_offset and time.monotonic() >= self._group_offset_due_at

    async def commit(self, final: bool = False) -> None:
        """Seal the open batch and commit it in one transaction, then write the store; a
        commit in flight is waited for first. `final` (before the partition closes): bring
        the group's offset up to date too. Any failure closes the partition for good."""
        async with self._commit_lock:
            if self.task is None or self.state not in (PartitionState.RUNNING, PartitionState.REBUILDING):
                raise RuntimeError(f"partition {self.number} is {self.state.value}")
            task = self.task
            with_group_offset = self.group_offset_due() or (final and self.group_offset != task.next_offset)
            if not task.has_pending and not with_group_offset:
                return
            self.last_commit_started = started = time.monotonic()
            batch = task.seal()
            consumed = {task.input: batch.end_offset} if with_group_offset else None
            assert self.producer is not None
            try:
                written = await self.producer.commit(batch.outputs, consumed, self.group_id)
            except BaseException as error:
                self.state = PartitionState.CLOSED
                self.failure = error
                task.overlay.release()
                raise
            task.committed(batch, written)
            TRANSACTION_RECORDS.observe(len(batch.outputs))
            COMMIT_SECONDS.observe(time.monotonic() - started)
            if with_group_offset:
                self.group_offset = batch.end_offset
                self._group_offset_due_at = time.monotonic() + self.group_offset_interval_s

    async def close(self) -> None:
        """Close the producer and the store, once a commit in flight is over."""
        async with self._commit_lock:
            self.state = PartitionState.CLOSED
            try:
                if self.producer is not None:
                    await self.producer.stop()
            finally:
                if self.task is not None:
                    self.task.close()

    async def abandon(self) -> None:
        """Close at once, the commit in flight cancelled and the producer let go: what a
        crash at this point leaves. A transaction the broker got has its changelog records
        with it, which the store restores from next time; else the next owner handles its
        commands again."""
        self.state = PartitionState.CLOSED
        # not when the commit loop itself abandons it (`_fail`, its commit over)
        if self.committing is not None and self.committing is not asyncio.current_task():
            self.committing.cancel()
            await asyncio.gather(self.committing, return_exceptions=True)
        if self.producer is not None:
            self.producer.let_go()
        if self.task is not None:
            self.task.close()


class TaskManager:
    def __init__(
        self,
        settings: Settings,
        registry: Registry,
        directory: StateDirectory,
        resources: StoreResources,
        group_id: str,
        on_restore_progress: Callable[[RestoreProgress], None] | None = None,
    ) -> None:
        self.settings = settings
        self.registry = registry
        self.topics = TopicNames(settings.app)
        self.directory = directory
        self.resources = resources
        self.group_id = group_id
        self.partitions: dict[int, Partition] = {}
        self.restores: dict[int, RestoreProgress] = {}
        self.consumer: AIOKafkaConsumer | None = None  # set by the Processor before it polls
        # Held while records are handled and while partitions come and go: a commit runs in
        # the background, and closing a partition waits for its commit in flight.
        self.lock = asyncio.Lock()
        self.on_restore_progress = on_restore_progress
        self._starting: dict[int, asyncio.Task[None]] = {}
        self._last_expiry = time.monotonic()
        # What the cluster's authorizer refused a task (a transactional id, a topic): no
        # retry helps until an operator grants it, so the processor stops, telling it.
        self.refused: Exception | None = None

    @property
    def tasks(self) -> dict[int, StreamTask]:
        """The running tasks, by partition."""
        return {n: p.task for n, p in self.partitions.items() if p.state is PartitionState.RUNNING and p.task is not None}

    @property
    def ready(self) -> bool:
        """Every partition it owns handles commands (none owned: nothing to wait for)."""
        return all(p.state is PartitionState.RUNNING for p in self.partitions.values())

    # -- handling and committing ---------------------------------------------------------

    async def process(self, fetched: Mapping[TopicPartition, list[ConsumerRecord[bytes, bytes]]]) -> None:
        """Hand fetched records to their tasks; call with `lock` held."""
        batch_max = self.settings.processor.batch_max_records
        for tp, records in fetched.items():
            partition = self.partitions.get(tp.partition)
            if partition is None or partition.state is not PartitionState.RUNNING:
                continue
            task = partition.running
            for start in range(0, len(records), YIELD_EVERY):
                if start:
                    await asyncio.sleep(0)
                task.process(records[start:start + YIELD_EVERY])
            if partition.committing is not None and task.pending_commands >= batch_max:
                self._consumer().pause(tp)  # a full batch waits for the commit in flight

    def poll_timeout_s(self) -> float:
        """How long the next poll may wait: until the first open batch is due."""
        waits = [self._commit_wait(p) for p in self._running() if p.running.has_pending and p.committing is None]
        return max(min(waits), 0.0) if waits else 0.2

    def schedule_commits(self, fetched: Mapping[TopicPartition, object]) -> None:
        """Start a commit for every partition whose open batch (or group offset) is due."""
        for partition in self._running():
            if partition.committing is None and (
                self._batch_due(partition, partition.running.input in fetched) or partition.group_offset_due()
            ):
                partition.committing = asyncio.create_task(self._commit_loop(partition), name=f"commit-{partition.number}")

    async def _commit_loop(self, partition: Partition) -> None:
        """Commit the open batch. What is handled meanwhile is the next batch, and is
        committed straight after (once spaced from this one, unless full): batches grow
        with the load, and no command waits for a poll to be committed."""
        try:
            while partition.running.has_pending or partition.group_offset_due():
                wait = self._commit_wait(partition)
                if wait > 0:
                    await asyncio.sleep(wait)
                await partition.commit()
        except Exception as error:
            async with self.lock:
                if self.partitions.get(partition.number) is partition:
                    await self._fail(partition, error)
        finally:
            partition.committing = None
            if self.partitions.get(partition.number) is partition and partition.state is PartitionState.RUNNING:
                self._consumer().resume(partition.running.input)

    def _batch_due(self, partition: Partition, still_fetching: bool) -> bool:
        """The open batch is to be committed now: it may be (`_commit_wait`), and it is full,
        or nothing more came for it, or it is as old as a batch may get."""
        task = partition.running
        if not task.has_pending or self._commit_wait(partition) > 0:
            return False
        p = self.settings.processor
        return task.pending_commands >= p.batch_max_records or not still_fetching or task.batch_age() >= p.commit_interval_ms / 1000

    def _commit_wait(self, partition: Partition) -> float:
        """Seconds until the partition may begin its next transaction: `commit_spacing_ms`
        after the last one began, or now if its open batch is full."""
        if partition.running.pending_commands >= self.settings.processor.batch_max_records:
            return 0.0
        return partition.last_commit_started + self.settings.processor.commit_spacing_ms / 1000 - time.monotonic()

    def close_deadline(self) -> float:
        """When partitions given up now close without their commits (the loop's time)."""
        return asyncio.get_running_loop().time() + self.settings.processor.close_timeout_ms / 1000

    async def commit_all(self, deadline: float) -> None:
        """At shutdown: every open batch, each after its commit in flight, until `deadline`:
        those still committing then are closed without (`close_all`)."""
        running = self._running()
        try:
            async with asyncio.timeout_at(deadline):
                results = await asyncio.gather(*(p.commit(final=True) for p in running), return_exceptions=True)
        except TimeoutError:
            return
        for partition, result in zip(running, results, strict=True):
            if isinstance(result, BaseException):
                log.warning("partition %d: last commit failed (%r); the next owner redoes it", partition.number, result)

    def punctuate(self) -> None:
        """Every `expiry_interval_s`: each task deletes what expired (retention, de-duplication)."""
        now = time.monotonic()
        if now - self._last_expiry < self.settings.processor.expiry_interval_s:
            return
        self._last_expiry = now
        for partition in self._running():
            expired = partition.running.expire(now_ms(), self.settings.processor.expiry_batch)
            if expired:
                EXPIRED.inc(expired)

    # -- lifecycle ---------------------------------------------------------------------

    def assign(self, numbers: set[int]) -> None:
        """Partitions given to this processor: each is paused and STARTING until its task is ready."""
        for number in numbers:
            if number not in self.partitions:
                self._consumer().pause(TopicPartition(self.topics.commands, number))
                self._start(number)

    async def revoke(self, numbers: set[int]) -> None:
        """Partitions taken away: the batch in hand is committed, producer and store closed,
        all within `close_timeout_ms`."""
        deadline = self.close_deadline()
        taken = []
        for number in numbers:
            partition = self.partitions.pop(number, None)
            starting = self._starting.pop(number, None)
            if starting is not None:
                starting.cancel()
            if partition is not None:
                taken.append(partition)
        await asyncio.gather(*(self._close(p, True, deadline) for p in taken))

    async def stop_starting(self) -> None:
        """Cancel the partitions still STARTING (before the consumer they use stops)."""
        starting = list(self._starting.values())
        for task in starting:
            task.cancel()
        await asyncio.gather(*starting, return_exceptions=True)

    async def close_all(self, deadline: float) -> None:
        await self.stop_starting()
        committing = [p.committing for p in self.partitions.values() if p.committing is not None]
        async with self.lock:
            closing, self.partitions = list(self.partitions.values()), {}
            await asyncio.gather(*(self._close(p, False, deadline) for p in closing))
        await asyncio.gather(*committing, return_exceptions=True)

    async def _fail(self, partition: Partition, error: BaseException) -> None:
        """A failed commit leaves nothing behind (the transaction aborted or was fenced, the
        store was not written): close the partition and, unless fenced, start it afresh."""
        self._consumer().pause(TopicPartition(self.topics.commands, partition.number))
        del self.partitions[partition.number]
        await self._close(partition, False, self.close_deadline())
        # its lag as it was would stand still until the task runs again (a broker away for
        # an hour): a dashboard and the lag alert read nothing rather than that (its other
        # gauges, its unusable aggregates say, hold for the task that starts again)
        with contextlib.suppress(KeyError):
            COMMANDS_LAG.remove(str(partition.number))
        if isinstance(error, ProducerFenced):
            log.warning("partition %d: fenced by a newer owner; giving it up", partition.number)
            return
        if isinstance(error, AUTHORIZATION_REFUSED):
            self.refused = error
            return
        log.error("partition %d: commit failed (%r); restarting its task", partition.number, error)
        self._start(partition.number)

    def _start(self, number: int) -> None:
        self.partitions[number] = Partition(
            number, self.group_id, group_offset_interval_s=self.settings.processor.group_offset_interval_ms / 1000
        )
        self._starting[number] = asyncio.create_task(self._start_until_ready(number), name=f"start-{number}")

    async def _start_until_ready(self, number: int) -> None:
        attempt = 0
        while True:
            try:
                built = await self.build(number)
                break
            except asyncio.CancelledError:
                raise
            except AUTHORIZATION_REFUSED as error:
                self.refused = error
                return
            except Exception:
                attempt += 1
                log.exception("partition %d: could not start its task (attempt %d)", number, attempt)
                await asyncio.sleep(min(0.5 * attempt, 5.0))
        registered = False
        try:
            async with self.lock:
                self._starting.pop(number, None)
                if self.partitions.get(number) is None or self.consumer is None:
                    return  # revoked meanwhile
                self.partitions[number] = built
                registered = True
                tp = TopicPartition(self.topics.commands, number)
                self.consumer.seek(tp, built.running.next_offset)
                self.consumer.resume(tp)
                ACTIVE_TASKS.set(len(self.tasks))
        finally:
            # Revoked meanwhile, or cancelled while it waited for the lock (a revoke holds
            # it): its producer and store are closed, not left to the collector.
            if not registered:
                await built.close()
        log.info("partition %d: ready at offset %d", number, built.running.next_offset)

    async def build(self, number: int) -> Partition:
        """A RUNNING partition, not yet registered: producer started (the previous owner
        fenced), store restored, position found."""
        consumer = self._consumer()
        partition = Partition(
            number, self.group_id, group_offset_interval_s=self.settings.processor.group_offset_interval_ms / 1000
        )
        partition.producer = StreamsProducer(self.settings, f"{self.group_id}.{number}", f"{self.group_id}-{number}")
        store = None
        try:
            # Fencing first: the changelog restored next can no longer change under us.
            await partition.producer.start()
            await self._changelog_settled(number)
            store = await self._restored_store(number)
            tp = TopicPartition(self.topics.commands, number)
            committed = await consumer.committed(tp)
            stored = store.get(position_key(number))
            start = max(
                committed if committed is not None else (await consumer.beginning_offsets([tp]))[tp],
                int(stored) if stored is not None else 0,
            )
            partition.group_offset = committed
            partition.task = StreamTask(
                number, self.topics, self.registry, store, start, dedup_window_ms=self.settings.processor.dedup_window_s * 1000,
                traced=self.settings.tracing.enabled,
            )
            partition.state = PartitionState.REBUILDING
            reader = functools.partial(committed_reader, self.settings, f"{self.group_id}-rebuild-{number}")
            await rebuild_stale_states(partition.task, reader, partition.commit, self._progress)
            partition.state = PartitionState.RUNNING
            return partition
        except BaseException:
            partition.state = PartitionState.CLOSED
            if store is not None:
                store.close()
            # not waited for: a rebuild's transaction in flight, cancelled by a stop during an
            # outage, would hold the stop until the broker is back
            partition.producer.let_go()
            raise

    async def _changelog_settled(self, number: int) -> None:
        """Wait until no transaction is open on the partition's changelog. Once the previous
        owner is fenced none is (its last commit or abort is marked; only the partition's owner
        writes there), but for a moment while a marker replicates, or for good when a broker
        lost the markers (docs/product.md, "Kafka versions"). The restore reads up to the first
        open transaction: a commit behind it would be restored without, its commands handled
        again once the next commit here marks it as committed too."""
        tp = TopicPartition(self.topics.changelog, number)
        waiting_since, told = time.monotonic(), -math.inf
        async with transaction_watch(self.settings) as open_transactions:
            while open_ := await open_transactions([tp]):
                stable, high = open_[tp]
                waited = time.monotonic() - waiting_since
                if waited >= CHANGELOG_SETTLE_WARN_S and waited - told >= CHANGELOG_SETTLE_REPEAT_S:
                    told = waited
                    log.error(
                        "partition %d: a transaction open on %s from offset %d (its end is %d) for %.0f s "
                        "after the previous owner was fenced; the partition waits for it. A broker that lost "
                        "its markers (Kafka 4.1 to 4.4, KAFKA-20734) leaves it open for good: list it with "
                        "kafka-transactions.sh find-hanging, check its records, and abort it with "
                        "kafka-transactions.sh abort (with every partition it left open)",
                        number, tp.topic, stable, high, waited,
                    )
                await asyncio.sleep(CHANGELOG_SETTLE_POLL_S)

    async def _restored_store(self, number: int) -> RocksDBStore:
        path = self.directory.store_path(number)
        store = await open_store(path, self.resources)
        reader = committed_reader(self.settings, f"{self.group_id}-restore-{number}")
        await reader.start()
        try:
            try:
                progress = await restore(reader, store, self.topics.changelog, [number], self._progress, expiry_index=True)
            except StaleStoreError as error:
                log.warning("partition %d: %s; rebuilding the store", number, error)
                store.close()
                RocksDBStore.destroy(path)
                store = await open_store(path, self.resources)
                progress = await restore(reader, store, self.topics.changelog, [number], self._progress, expiry_index=True)
            self.restores[number] = progress[number]
            RESTORE_RECORDS.labels("processor").inc(progress[number].restored)
            return store
        except BaseException:
            store.close()
            raise
        finally:
            await stop_consumer(reader)

    def _progress(self, progress: RestoreProgress) -> None:
        if progress.what == "restoring":
            self.restores[progress.partition] = progress
        labels = ("processor" if progress.what == "restoring" else progress.what, str(progress.partition))
        RESTORE_REMAINING.labels(*labels).set(progress.remaining)
        RESTORE_RATE.labels(*labels).set(progress.rate)
        if self.on_restore_progress is not None:
            self.on_restore_progress(progress)

    async def _close(self, partition: Partition, commit: bool, deadline: float) -> None:
        ACTIVE_TASKS.set(len(self.tasks))
        try:
            async with asyncio.timeout_at(deadline):
                if commit and partition.state is PartitionState.RUNNING:
                    try:
                        await partition.commit(final=True)  # after the commit in flight, if any
                    except Exception as error:  # fenced or failed: the next owner redoes the batch
                        # the commit in flight's failure, when it is what closed the partition: the
                        # commit loop leaves a partition already taken away to this close to tell
                        failed, what = (error, "final commit") if partition.failure in (None, error) else (partition.failure, "last commit")
                        log.warning("partition %d: %s failed (%r); the next owner redoes it", partition.number, what, failed)
                await partition.close()
        except TimeoutError:
            log.warning(
                "partition %d: closed at once, its commit or close not over within %.0f s of the partition being given "
                "up (a broker away?): what it did not commit is handled again by the next owner",
                partition.number, self.settings.processor.close_timeout_ms / 1000,
            )  # fmt: skip
            await partition.abandon()

    def _running(self) -> list[Partition]:
        return [p for p in self.partitions.values() if p.state is PartitionState.RUNNING]

    def _consumer(self) -> AIOKafkaConsumer:
        assert self.consumer is not None, "the TaskManager has no consumer yet"
        return self.consumer
