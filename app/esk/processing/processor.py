"""The processor: one consumer group on `<app>.commands`, polled in one loop.

The loop fetches commands and hands them to the TaskManager, which owns every assigned
partition's lifecycle (its StreamTask, its StreamsProducer, when it commits). Assignment is
esk's own (StandbyAssignor): sticky, and a partition that must move goes to the member with
the warmest copy of its store. With `standby_replicas`, members keep such copies
(StandbyTasks) of partitions they do not own.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition

from ..kafka.reader import group_member
from ..kafka.stopping import stop_consumer
from ..kafka.topics import TopicNames, processor_group
from ..metrics import COMMANDS_LAG, REVOKE_SECONDS, STORE_MEMORY, forget_partitions
from ..processes import hold_lock
from ..registry import Registry
from ..settings import Settings
from ..state.directory import StateDirectory
from ..state.resources import StoreResources
from ..state.restore import RestoreProgress
from .assignor import StandbyAssignor
from .standby import StandbyTasks
from .stream_task import StreamTask
from .task_manager import TaskManager

log = logging.getLogger(__name__)

# How often, at most, the state directory is looked over for stores no longer kept here.
STATE_CLEANUP_CHECK_S = 30.0
PROCESSOR_LOCK = "processor.lock"


class Processor:
    def __init__(
        self,
        settings: Settings,
        registry: Registry,
        on_restore_progress: Callable[[RestoreProgress], None] | None = None,
    ) -> None:
        self.settings = settings
        self.topics = TopicNames(settings.app)
        self.group_id = processor_group(settings)
        self.directory = StateDirectory(settings.processor.state_dir, self.topics.commands)
        self.resources = StoreResources(settings.processor.memory_budget_mb)
        self.task_manager = TaskManager(settings, registry, self.directory, self.resources, self.group_id, on_restore_progress)
        self.standbys = StandbyTasks(settings, self.topics.changelog, self.resources, self.directory.store_path)
        self.assignor = StandbyAssignor(self.topics.commands, settings.processor.standby_replicas, self._warm_copies)
        self._consumer: AIOKafkaConsumer | None = None
        # Until the first assignment, and while a rebalance is under way, every store looks
        # unused: none is removed then.
        self._rebalancing = True
        self._next_cleanup = 0.0
        self._deleting: set[asyncio.Task[None]] = set()

    @property
    def ready(self) -> bool:
        """In the group, its assignment taken, and every partition of it handling commands.
        A processor the group gave no partition (more of them than partitions) is ready
        too: were it not, a disruption budget of one would let no pod be evicted."""
        return self._consumer is not None and not self._rebalancing and self.task_manager.ready

    @property
    def tasks(self) -> dict[int, StreamTask]:
        return self.task_manager.tasks

    @property
    def restores(self) -> dict[int, RestoreProgress]:
        return self.task_manager.restores

    def consumer(self) -> AIOKafkaConsumer:
        """The group's consumer; make it inside the running loop."""
        p = self.settings.processor
        return group_member(
            self.settings,
            self.group_id,
            p.session_timeout_ms,
            p.max_poll_interval_ms,
            # Ours alone: aiokafka (0.14) sends a JoinGroup for each assignor it is given, each
            # with other protocols, and each of those starts the group's rebalance anew.
            partition_assignment_strategy=(self.assignor,),
        )

    async def run(self, stop: asyncio.Event) -> None:
        # One processor over a state directory: another would open its stores as they close
        # in a rebalance, and the cleanup below could take the other's stores.
        lock = hold_lock(self.directory.root / PROCESSOR_LOCK)
        try:
            await self._run(stop)
        finally:
            if lock is not None:
                lock.close()

    async def _run(self, stop: asyncio.Event) -> None:
        consumer = self.consumer()
        consumer.subscribe([self.topics.commands], listener=_RebalanceListener(self))
        log.info("joining the group %s for %s's partitions", self.group_id, self.topics.commands)
        # set before start(): the rebalance listener may run inside it
        self._consumer = self.task_manager.consumer = consumer
        standbys_stop = asyncio.Event()
        standbys = None
        if self.settings.processor.standby_replicas > 0:
            standbys = asyncio.create_task(self.standbys.run(standbys_stop), name="standbys")
        self._delete(self.directory.set_aside_earlier())
        closing_by: float | None = None
        try:
            if await _unless_stopped(consumer.start(), stop):
                while not stop.is_set():
                    await self._poll_once(consumer)
                    self._clean_state_directory(consumer)
                closing_by = self.task_manager.close_deadline()
                async with self.task_manager.lock:
                    await self.task_manager.commit_all(closing_by)
        finally:
            standbys_stop.set()
            await self.task_manager.stop_starting()
            await stop_consumer(consumer)
            await self.task_manager.close_all(self.task_manager.close_deadline() if closing_by is None else closing_by)
            if standbys is not None:
                await standbys
            await asyncio.gather(*self._deleting, return_exceptions=True)
            self._consumer = None

    async def _poll_once(self, consumer: AIOKafkaConsumer) -> None:
        manager = self.task_manager
        fetched = await consumer.getmany(
            timeout_ms=round(manager.poll_timeout_s() * 1000), max_records=self.settings.processor.batch_max_records
        )
        if manager.refused is not None:
            raise manager.refused
        async with manager.lock:
            await manager.process(fetched)
            manager.punctuate()
            manager.schedule_commits(fetched)
        STORE_MEMORY.labels("processor").set(self.resources.usage_bytes())
        for number, task in manager.tasks.items():
            if (end := consumer.last_stable_offset(task.input)) is not None:  # known once a fetch answered
                handled = max(task.next_offset, _position(consumer, task.input) or 0)
                COMMANDS_LAG.labels(str(number)).set(max(end - handled, 0))

    def _clean_state_directory(self, consumer: AIOKafkaConsumer) -> None:
        """Removes the stores of partitions neither owned nor kept warm here for
        `state_cleanup_delay_s`. In one go from what is in use to the renames, with no
        await between: a rebalance cannot hand a partition over meanwhile."""
        delay_s, now = self.settings.processor.state_cleanup_delay_s, time.monotonic()
        if self._rebalancing or now < self._next_cleanup:
            return
        self._next_cleanup = now + min(STATE_CLEANUP_CHECK_S, delay_s)
        in_use = (
            set(self.task_manager.partitions)  # starting ones too
            | {tp.partition for tp in consumer.assignment()}
            | self.assignor.standby
            | self.standbys.partitions
        )
        aside = self.directory.set_aside_unused(in_use, delay_s, now)
        if aside:
            log.info("removing the stores of partitions %s: neither owned nor kept warm here for %.0f s", sorted(aside), delay_s)
            self._delete(aside.values())

    def _delete(self, paths: Iterable[Path]) -> None:
        """Deletes the stores set aside in a thread: a large one takes a while."""
        if paths := list(paths):
            deleting = asyncio.create_task(asyncio.to_thread(self.directory.delete, paths), name="state-cleanup")
            self._deleting.add(deleting)
            deleting.add_done_callback(self._deleting.discard)

    def _warm_copies(self) -> dict[int, int]:
        """What this member tells the group leader it has: its standby copies with their
        changelog offsets as they are, and any other store on disk with those of its last
        clean close (the eager protocol has closed the active ones before it joins)."""
        return self.directory.copies_on_disk() | self.standbys.offsets()

    async def _on_assigned(self, assigned: set[TopicPartition]) -> None:
        numbers = {tp.partition for tp in assigned}
        # each rebalance, said: a member that waits in one, or is given nothing, is otherwise silent
        if numbers:
            log.info("assigned partitions %s", sorted(numbers))
        else:
            log.info("assigned no partition (the group's other members own them all)")
        # Standby copies that turned active are closed first: the active task opens the same store.
        await self.standbys.assign(self.assignor.standby - numbers)
        self.task_manager.assign(numbers)
        self.directory.mark_used(numbers | self.assignor.standby)
        self._rebalancing = False

    async def _on_revoked(self, revoked: set[TopicPartition]) -> None:
        self._rebalancing = True
        started = time.monotonic()
        async with self.task_manager.lock:
            await self.task_manager.revoke({tp.partition for tp in revoked})
        elapsed = time.monotonic() - started
        REVOKE_SECONDS.observe(elapsed)
        forget_partitions(tp.partition for tp in revoked)
        if revoked:
            log.info("gave up partitions %s in %.3fs", sorted(tp.partition for tp in revoked), elapsed)


async def _unless_stopped(starting: Awaitable[None], stop: asyncio.Event) -> bool:
    """`starting` awaited, unless `stop` is set first (a SIGTERM while a consumer's start
    waits for a broker or for its topics, for as long as its request timeout): then it is
    cancelled. Whether it finished."""
    started = asyncio.ensure_future(starting)
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({started, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
    if not started.done():
        started.cancel()
        await asyncio.gather(started, return_exceptions=True)
        return False
    started.result()
    return True


class _RebalanceListener(ConsumerRebalanceListener):  # type: ignore[misc]  # aiokafka ships no type hints
    def __init__(self, processor: Processor) -> None:
        self.processor = processor

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        await self.processor._on_revoked(revoked)

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        await self.processor._on_assigned(assigned)


def _position(consumer: AIOKafkaConsumer, tp: TopicPartition) -> int | None:
    """The consumer's position on `tp`, past every record it has handed out (the task has
    handled them all by then) and past a transaction's commit marker once fetched: a marker
    takes an offset and holds no command, and a partition whose last record is a reactor's
    command would read one behind for ever. None while it has none; aiokafka's
    `position()` would wait for one, so its state is read as it is."""
    try:
        state = consumer._subscription.subscription.assignment.state_value(tp)
        return int(state.position) if state is not None and state.has_valid_position else None
    except AttributeError:  # unsubscribed meanwhile (a rebalance), or aiokafka's state changed shape
        return None
