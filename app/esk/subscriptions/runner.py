"""SubscriptionRunner: one subscription's consumer group member (`esk subscriber NAME`).

The group is `<app>.subscription.<name>`; it reads the events topics of the aggregate types
the subscription reads (and `<app>.results`, for a reactor's outcome handlers). Each
assigned partition is an InputPartition: a task that takes the partition (its sink fences
the previous owner and says where to start), then handles what the poll loop hands it,
one fetched chunk at a time.

The partition is paused from the moment a chunk is handed over until it is handled, so a
handler that retries for minutes holds back its own partition only; the loop goes on
polling (which keeps the member in the group, max.poll.interval.ms) and feeding the others.
A partition whose commit fails, fenced or otherwise, starts again from what its sink says.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import IllegalStateError
from aiokafka.structs import ConsumerRecord

from ..domain.aggregate import AggregateType, one_line
from ..kafka.acls import AUTHORIZATION_REFUSED
from ..kafka.reader import group_member
from ..kafka.stopping import stop_consumer
from ..metrics import SUBSCRIPTION_CAUGHT_UP, SUBSCRIPTION_LAG, SUBSCRIPTION_PARKED, SUBSCRIPTION_PARTITIONS
from ..settings import Settings
from .api import AnySubscription
from .parking import PARKED_RESULTS
from .routing import Router, check_outcome_commands
from .sinks import Fenced
from .stores import DatabaseUnreachable, Stores, group_id
from .worker import FailedWithItsUnit, PartitionWorker

log = logging.getLogger(__name__)

Chunk = tuple[Sequence[ConsumerRecord[bytes, bytes]], int]  # records, and the position after them
RESTART_DELAYS_S = (0.5, 1.0, 2.0, 5.0)
# A partition that keeps failing to start, or a database awaited at the subscriber's start,
# is told again this often (each try in between at DEBUG): an outage of a minute would
# otherwise write a warning per partition every few seconds.
STILL_FAILING_EVERY_S = 60.0
DATABASE_WAIT_S = 5.0  # between tries to reach a database handler's database at the start
IDLE_CHECK_S = 1.0
PARKED_REPORT_S = 10.0  # how often the subscriber reads how many events its partitions hold parked
LAG_REPORT_S = 2.0  # how often it asks the brokers for its partitions' ends (esk_subscription_lag)
# A partition's task still running this long after a cancellation is cancelled again:
# longer than a unit's abort takes (a rollback, a transaction's abort), which a second
# cancellation would cut short.
CANCEL_AGAIN_S = 5.0
CANCEL_TRIES = 6
# How often a stop or a rebalance looks whether a partition it waits for went into a retry's
# backoff instead (the worker tells it no other way).
SETTLED_POLL_S = 0.05
_LEFT_TO_ITSELF: set[asyncio.Task[None]] = set()  # tasks that outlasted every cancellation, held until they end


class InputPartition:
    """One assigned input partition: its worker, started (and started again) in a task."""

    def __init__(self, runner: SubscriptionRunner, tp: TopicPartition) -> None:
        self.runner = runner
        self.tp = tp
        self.worker: PartitionWorker | None = None
        self.running = False  # started: records handed over are handled
        self._idle = asyncio.Event()  # clear while a chunk is handed over and not yet handled
        self._idle.set()
        self.failing = False  # failed, and not started again since (its database away, say)
        self._chunks: asyncio.Queue[Chunk] = asyncio.Queue()
        self._suspects: dict[int, Exception] = {}  # PartitionWorker.suspects, across its starts
        self._committed: int | None = None  # as last known: kept while the partition starts again
        self._task = asyncio.create_task(self._run(), name=f"{runner.subscription.name}-{tp.topic}-{tp.partition}")

    def committed_offset(self) -> int | None:
        """Where its committed position stands, as last known (None: not known yet): while
        its worker starts again (its database away, say) the position stands still, and the
        records behind it are the lag all the same."""
        worker = self.worker
        if worker is not None and (worker.next_offset is not None or self.running):
            self._committed = worker.next_offset or 0
        return self._committed

    @property
    def busy(self) -> bool:
        return not self._idle.is_set()

    @busy.setter
    def busy(self, busy: bool) -> None:
        if busy:
            self._idle.clear()
        else:
            self._idle.set()

    @property
    def backing_off(self) -> bool:
        return self.worker is not None and self.worker.backing_off

    async def settled(self) -> None:
        """Returns once no chunk is in hand (handled and committed, or given up), or its worker
        waits to try a failed event again."""
        while not self._idle.is_set() and not self.backing_off:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), SETTLED_POLL_S)

    def hand_over(self, chunk: Chunk) -> None:
        self.busy = True
        self.runner.consumer.pause(self.tp)
        self._chunks.put_nowait(chunk)

    async def stop(self) -> None:
        """Cancels its task, and again while it goes on: a handler may swallow a cancellation
        (Python 3.11's `asyncio.wait_for` does, when what it waits for ends at that moment; so
        does an `except BaseException`), and a stop or a rebalance must not wait for it for
        ever. One that outlasts every try is left to itself: its commit is fenced, as a
        frozen member's is."""
        for _ in range(CANCEL_TRIES):
            self._task.cancel()
            await asyncio.wait({self._task}, timeout=CANCEL_AGAIN_S)
            if self._task.done():
                break
            log.warning("%s: %s/%s went on after it was cancelled (its handler swallowed the cancellation?): cancelled again",
                        self.runner.subscription.name, self.tp.topic, self.tp.partition)
        else:
            log.error("%s: %s/%s goes on after %d cancellations: left to itself, its commit fenced",
                      self.runner.subscription.name, self.tp.topic, self.tp.partition, CANCEL_TRIES)
            _LEFT_TO_ITSELF.add(self._task)
            self._task.add_done_callback(_LEFT_TO_ITSELF.discard)
            return
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    async def _run(self) -> None:
        failing = _Failing()
        while True:
            self.worker = PartitionWorker(
                self.runner.subscription, self.runner.router, self.runner.stores.sink(self.tp),
                traced=self.runner.settings.tracing.enabled, suspects=self._suspects,
            )
            try:
                await self._start(self.worker, failing.since_first())
                failing = _Failing()
                self.failing = False
                while True:
                    records, end = await self._chunks.get()
                    await self.worker.handle(records, end)
                    self._resume()
            except asyncio.CancelledError:
                raise
            except AUTHORIZATION_REFUSED as error:
                self.runner.refused = error  # no retry helps until an operator grants it
                return
            except Exception as error:
                if isinstance(error, FailedWithItsUnit):
                    self._suspects[error.offset] = error.error
                delay = RESTART_DELAYS_S[min(failing.tries + 1, len(RESTART_DELAYS_S)) - 1]
                where = f"{self.runner.subscription.name}: {self.tp.topic}/{self.tp.partition}"
                if isinstance(error, Fenced):
                    # An operator's reset, or the partition's next owner after a rebalance: the
                    # fence doing its job, not a failure (a start after it reads the offset anew).
                    log.info("%s starts again in %.1fs, from where its offset stands now: %s", where, delay, one_line(error))
                else:
                    failing.tell(error, f"{where} starts again in {delay:.1f}s after ")
                self.running = self.busy = False
                self.failing = True
                self.runner.consumer.pause(self.tp)
                while not self._chunks.empty():
                    self._chunks.get_nowait()  # read again from where the partition starts
                await asyncio.sleep(delay)
            finally:
                self.running = False
                await _quietly(self.worker.close())

    async def _start(self, worker: PartitionWorker, after: str) -> None:
        consumer = self.runner.consumer
        consumer.pause(self.tp)
        start = await worker.open()
        if start is None:
            await consumer.seek_to_beginning(self.tp)
        else:
            consumer.seek(self.tp, start)
        self.running = True
        self._resume()
        log.info(
            "%s: %s/%s started at %s%s", self.runner.subscription.name, self.tp.topic, self.tp.partition,
            "the beginning" if start is None else start, after,
        )

    def _resume(self) -> None:
        self.busy = False
        if self.tp in self.runner.consumer.assignment():
            self.runner.consumer.resume(self.tp)


class _Failing:
    """Tries in a row that failed the same way, and what the log was told of them: the
    first, then each STILL_FAILING_EVERY_S, and another failure at once."""

    def __init__(self) -> None:
        self.tries = 0
        self.first = 0.0
        self.told: float | None = None
        self.reason = ""

    def tell(self, error: Exception, what: str) -> None:
        """`what` happens after `error` (in a line, after it)."""
        reason, now = one_line(error), time.monotonic()
        self.tries += 1
        if self.tries == 1:
            self.first = now
        if reason != self.reason or self.told is None or now - self.told >= STILL_FAILING_EVERY_S:
            again = f" (failing so for {now - self.first:.0f}s, {self.tries} tries)" if reason == self.reason else ""
            log.warning("%s%s%s", what, reason, again)
            self.reason, self.told = reason, now
        else:
            log.debug("%s%s", what, reason)

    def since_first(self) -> str:
        """What a start after them says of them."""
        return f", after {self.tries} failed tries over {time.monotonic() - self.first:.0f}s" if self.tries else ""


async def _quietly(closing: Any) -> None:
    try:
        await closing
    except Exception as error:
        log.warning("closing failed: %r", error)


class SubscriptionRunner:
    def __init__(self, settings: Settings, subscription: AnySubscription, registry: Mapping[str, AggregateType[Any]]) -> None:
        check_outcome_commands(subscription, registry)
        self.settings = settings
        self.subscription = subscription
        self.router = Router(subscription, registry, settings.app)
        self.stores = Stores(settings, subscription, self.router)
        self.group_id = group_id(settings, subscription)
        self.partitions: dict[TopicPartition, InputPartition] = {}
        self._consumer: AIOKafkaConsumer | None = None
        self._open = False  # running, its stores open (a database handler's database answered)
        # What the cluster's authorizer refused a partition (a transactional id, a topic): the
        # subscriber stops, telling it.
        self.refused: Exception | None = None

    @property
    def consumer(self) -> AIOKafkaConsumer:
        if self._consumer is None:
            raise RuntimeError("the runner is not running")
        return self._consumer

    @property
    def ready(self) -> bool:
        """Running, its stores open, and none of its partitions failing (a database handler's
        database gone since, say): what /readyz tells. Its lag is in /metrics."""
        # Asked from the operations thread: a copy, as a rebalance may change them meanwhile.
        return self._open and not any(p.failing for p in list(self.partitions.values()))

    @property
    def caught_up(self) -> bool:
        """Every partition owned and started, and handled up to its end as last fetched."""
        return bool(self.partitions) and all(lag == 0 for lag in self.lags().values())

    def lags(self) -> dict[TopicPartition, int | None]:
        """Records of each owned partition not handled yet (None: not known yet)."""
        lags: dict[TopicPartition, int | None] = {}
        for tp, partition in self.partitions.items():
            end = self.consumer.last_stable_offset(tp) if partition.running else None
            worker = partition.worker
            if end is None or worker is None:
                lags[tp] = None
            else:
                lags[tp] = max(0, end - (worker.next_offset or 0))
        return lags

    def _make_consumer(self) -> AIOKafkaConsumer:
        s = self.settings.subscriber
        return group_member(
            self.settings, self.group_id, s.session_timeout_ms, s.max_poll_interval_ms, fetch_max_wait_ms=s.fetch_max_wait_ms
        )

    async def run(self, stop: asyncio.Event) -> None:
        self._consumer = consumer = self._make_consumer()
        opened = False
        try:
            opened = await self._open_stores(consumer, stop)
        finally:
            if not opened:  # a stop meanwhile, or a database that answers and refuses
                await stop_consumer(consumer)  # made, never started: closed all the same
                self._consumer = None
        if not opened:
            return
        self._open = True
        consumer.subscribe(self.router.topics, listener=_Listener(self))
        # Beside the loop, not in it: the count waits for the store, which a long unit of a
        # partition holds (a database handler's transaction), and the loop must go on
        # fetching for the others.
        counting: asyncio.Task[None] | None = None
        measuring: asyncio.Task[None] | None = None
        try:
            await consumer.start()
            idle_checked = time.monotonic()
            parked_reported = lag_reported = 0.0
            while not stop.is_set():
                fetched = await consumer.getmany(timeout_ms=200, max_records=self.settings.subscriber.batch_max_records)
                if self.refused is not None:
                    raise self.refused
                for tp, records in fetched.items():
                    partition = self.partitions.get(tp)
                    if partition is not None and partition.running and records:
                        position = await self._position(tp)
                        if position is not None:
                            partition.hand_over((records, position))
                if time.monotonic() - idle_checked >= IDLE_CHECK_S:
                    idle_checked = time.monotonic()
                    await self._move_idle_offsets()
                    self._report()
                if time.monotonic() - parked_reported >= PARKED_REPORT_S and (counting is None or counting.done()):
                    parked_reported = time.monotonic()
                    counting = asyncio.create_task(self._report_parked(), name=f"{self.subscription.name}-parked-count")
                if time.monotonic() - lag_reported >= LAG_REPORT_S and (measuring is None or measuring.done()):
                    lag_reported = time.monotonic()
                    measuring = asyncio.create_task(self._report_lags(), name=f"{self.subscription.name}-lag")
        finally:
            for task in (counting, measuring):
                if task is not None:
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
            # Only a stop waits for the chunks in hand: a failure ends the run at once, and the
            # next run starts from the committed positions.
            await self._give_up(set(self.partitions), "stopping" if stop.is_set() else None)
            await stop_consumer(consumer)
            self._consumer = None
            self._open = False
            await self.stores.close()

    async def _give_up(self, partitions: set[TopicPartition], why: str | None) -> None:
        """Stops the partitions' workers. Given a `why`, their chunks in hand go on to their
        commit first, for the stop grace at most, rather than be given up for the partitions'
        next owner to handle all over again: on a stop, and when a rebalance takes partitions
        away (their offsets still commit then: the group waits for this member to rejoin). One
        waiting to try a failed event again is not waited for: what came before it is committed,
        and the event is the next owner's to try."""
        busy = [p for tp, p in self.partitions.items() if tp in partitions and p.busy and p.running and not p.backing_off]
        if why is not None and busy:
            grace_s = self.settings.subscriber.stop_grace_s
            log.info("%s: %s once the %d chunks in hand are committed (%.0fs at most)", self.subscription.name, why, len(busy), grace_s)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.gather(*(p.settled() for p in busy)), grace_s)
        await self._revoke(partitions)

    async def _open_stores(self, consumer: AIOKafkaConsumer, stop: asyncio.Event) -> bool:
        """Opens the stores, waiting for a database handler's database that does not answer
        yet, as the subscriber waits for a broker: a subscriber started in a database's outage
        (a restarted pod) would otherwise fail, and its restarts back off further each time.
        False when asked to stop meanwhile."""
        failing = _Failing()
        while True:
            try:
                await self.stores.open(consumer)
            except DatabaseUnreachable as error:
                failing.tell(error.cause, f"{self.subscription.name}: its database {error.where} does not answer, waiting for it: ")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), DATABASE_WAIT_S)
                if stop.is_set():
                    return False
                continue
            if failing.tries:
                log.info("%s: its database answers%s", self.subscription.name, failing.since_first())
            return True

    async def _move_idle_offsets(self) -> None:
        """Every idle partition gets an empty chunk: one whose position moved past records it
        never handed over (transaction markers, aborted records) commits that position, so
        that its lag reaches 0; the others check that the partition is still theirs."""
        for tp, partition in list(self.partitions.items()):
            worker = partition.worker
            if partition.running and not partition.busy and worker is not None:
                position = await self._position(tp)
                if position is not None and (worker.next_offset is not None or position > 0):
                    partition.hand_over(([], position))

    async def _position(self, tp: TopicPartition) -> int | None:
        """The consumer's position (None: the partition was just taken away by a rebalance)."""
        try:
            position: int = await self.consumer.position(tp)
        except IllegalStateError:
            return None
        return position

    async def _report_lags(self) -> None:
        """Each owned partition's records past its committed position, from the partitions'
        ends as the brokers have them now: the ends the fetches last saw stand still while a
        partition is paused (a chunk in hand, its worker starting again), and so did the
        gauge, while a slow handler or a database away held the records back."""
        owned = list(self.partitions)
        if not owned:
            return
        try:
            ends = await self.consumer.end_offsets(owned)  # read_committed: the last stable offsets
        except Exception as error:  # a broker away: the next look
            log.debug("%s: partitions' ends not read: %r", self.subscription.name, error)
            return
        for tp, end in ends.items():
            partition = self.partitions.get(tp)
            committed = None if partition is None else partition.committed_offset()
            if committed is not None:
                SUBSCRIPTION_LAG.labels(self.subscription.name, tp.topic, str(tp.partition)).set(max(0, end - committed))

    def _report(self) -> None:
        name = self.subscription.name
        SUBSCRIPTION_PARTITIONS.labels(name).set(sum(p.running for p in self.partitions.values()))
        SUBSCRIPTION_CAUGHT_UP.labels(name).set(1 if self.caught_up else 0)

    async def _report_parked(self) -> None:
        """Read from the store, not from the workers' own view: a retry from the command line
        resolves parked events under a worker that never sees it."""
        owned = [tp for tp, partition in self.partitions.items() if partition.running]
        try:
            counts = await self.stores.parked_counts(owned)
        except Exception as error:  # a store away: the partitions say so; the gauge waits for the next look
            log.debug("%s: parked events not counted: %r", self.subscription.name, error)
            return
        for tp, by_result in counts.items():
            if tp in self.partitions:  # still this member's
                for result, count in by_result.items():
                    SUBSCRIPTION_PARKED.labels(self.subscription.name, tp.topic, str(tp.partition), result).set(count)

    async def _assign(self, assigned: set[TopicPartition]) -> None:
        for tp in assigned:
            self.consumer.pause(tp)  # until its sink says where to start
            if tp not in self.partitions:
                self.partitions[tp] = InputPartition(self, tp)

    async def _revoke(self, revoked: set[TopicPartition]) -> None:
        stopping = [self.partitions.pop(tp) for tp in revoked if tp in self.partitions]
        await asyncio.gather(*(p.stop() for p in stopping))
        for tp in revoked:
            labels = (self.subscription.name, tp.topic, str(tp.partition))
            for gauge, label_sets in ((SUBSCRIPTION_LAG, [labels]), (SUBSCRIPTION_PARKED, [(*labels, r) for r in PARKED_RESULTS])):
                for label_set in label_sets:
                    with contextlib.suppress(KeyError):  # never reported
                        gauge.remove(*label_set)


class _Listener(ConsumerRebalanceListener):  # type: ignore[misc]  # aiokafka ships no type hints
    def __init__(self, runner: SubscriptionRunner) -> None:
        self.runner = runner

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        await self.runner._give_up(revoked, "giving partitions up")

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        await self.runner._assign(assigned)
