"""Runs a projection: Kafka events -> foreachBatch -> idempotent writes into Delta.

Exactly once: Structured Streaming may run a micro-batch again after a crash (the Delta
commit happened, the checkpoint's commit did not). Every write of a batch therefore carries
Delta's txnAppId/txnVersion (the batch id), and Delta skips a write whose (app id,
version) it has committed already. The app id includes the table generation, since a new
generation starts with a new checkpoint and batch ids from 0.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from types import FrameType
from typing import Any, NamedTuple

from delta.tables import DeltaTable
from py4j.protocol import Py4JJavaError
from pyspark.errors import AnalysisException
from pyspark.errors.exceptions.captured import CapturedException
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.streaming.query import StreamingQuery
from pyspark.sql.streaming.readwriter import DataStreamWriter
from pyspark.sql.types import StructType
from rich.console import Console

from ..domain.aggregate import UnknownEventType
from ..kafka.client_options import KafkaAccessError, check_access
from ..processes import set_from_signal_handler
from ..registry import load_registry
from ..settings import Settings
from .catalog import BatchWriter, PlanCheck, PlanEnds, Probe, Projection, ReadModel, ReadModelMistake, Tables, session_conf
from .events import decode, event_stream, newer_version, no_events, older_version, reading, upcast
from .parking import Failure, ParkedAggregate, find_parked, held_back
from .positions import checkpoint_positions, read_model_positions
from .run_lock import GRACE_S, GenerationBusy, GenerationLock, Keeper
from .session import QUERY_FAILURE_LOGGER, loggers_off, spark_session, task_failures_untold

# Delta settings for many small writes on a few cores: Delta rebuilds a table's snapshot
# state in 50 tasks by default, each a task to schedule whatever the table's size. (A MERGE
# still copies its source first, Delta's default: a source that reads the batch and the
# table several times is cheaper to read once.)
DELTA_CONF = {"spark.databricks.delta.snapshotPartitions": "2"}
# What a run says goes to the process's log, as every esk process's does (one handler:
# text or JSON lines); only the closing summaries go to the console `run_and_report` is given.
log = logging.getLogger(__name__)

# New tables keep the log and the files that compaction replaced for a day, not Delta's
# 30 and 7 days: a read model has no use for time travel, and a reader's snapshot lives
# for one request.
TABLE_PROPERTIES = {
    "delta.logRetentionDuration": "interval 1 day",
    "delta.deletedFileRetentionDuration": "interval 1 day",
}
VACUUM_EVERY_S = 3600.0  # a continuous run removes unreferenced files this often
# Events a batch at most for a continuous run building a generation beside the one readers
# use, unless ESK_PROJECTIONS__MAX_OFFSETS_PER_TRIGGER says otherwise: it takes the catch-up
# turn a batch at a time. (A bounded catch-up is slower: 500,000 a batch took 1.3x one batch's
# time over 1,000,000 events, docs/benchmarks.md.)
REBUILD_BESIDE_BATCH_MAX = 500_000
RETIRE_EVERY_S = 60.0  # and looks this often for generations readers left long enough ago
# What fails a batch's job at an event of another schema version than the code's, the
# events applied before their versions were counted (`_keep`).
VERSIONS_GUARD = "esk: an event of another schema version than this code's: its batch is applied again, its versions counted first"
# How long a rebuild waits for the run that keeps readers' generation to take over the one it
# built and switch readers (`_hand_over`): that run notices at its next look (POLL_S), and
# stops between batches.
HAND_OVER_WAIT_S = 60.0
HAND_OVER_POLL_S = 0.2
LAG_REPORT_EVERY_S = 10  # and looks at its lag this often, to log it when it changed
POLL_S = 1  # seconds: how soon a run notices it is asked to stop
KAFKA_CHECK_S = 5.0  # how long a run waiting for a broker gives one to answer, each time
# A batch in flight this long makes a run ask whether a broker answers (once per this long).
STALL_CHECK_S = 30.0
# How long a stop waits for the batch in flight: below the grace a supervisor gives before
# it kills (Kubernetes: 30 s). A batch still running then is interrupted, and runs again
# at the next start (its writes are idempotent).
STOP_WAIT_S = 20.0
# And how long the query's stop then waits for its thread, which a Kafka request in flight
# holds (a broker away: for its whole timeout); then the run ends without it, which the
# next start's checkpoint makes harmless.
QUERY_STOP_TIMEOUT_S = 5.0
# A continuous run waiting for a generation another run keeps says who keeps it this often.
LOCK_REPORT_EVERY_S = 300.0
NEWER_REPORT_EVERY_S = 300.0  # how often a run waiting for code that knows newer events says so again
# Every batch adds files, whichever writer wrote it: the runner compacts them (delta-rs, in
# the batch, so never beside a write) every so many batches. Spark's auto compaction would
# follow Spark's writes only, and rewrote a catch-up's first write at once.
COMPACT_EVERY = 50


@dataclass
class RunSummary:
    name: str
    generation: int
    batches: int = 0
    events: int = 0
    rows: int = 0
    lag: dict[str, int] = field(default_factory=dict)
    caught_up: bool = False  # False: stopped before it had read up to the newest events
    standby: bool = False  # stopped while it waited for another run to let go of the generation
    started: bool = True  # False: stopped before it held a generation (its driver starting, say)
    held_up: bool = False  # it stood still before a batch of events newer than its code: its lag not known
    # A rebuild's: readers' generation was kept by another run, which it left the switch to (_hand_over)
    handed_over: bool = False
    taking_over: int | None = None  # a continuous run's: the rebuilt generation it leaves its own for


class Held(NamedTuple):
    """The generation a run keeps, locked (run_lock.py), and whether the run builds it:
    readers do not use it yet (a first run, or a rebuild)."""

    lock: GenerationLock
    building: bool


def run(
    settings: Settings,
    projection: Projection,
    continuous: bool = False,
    rebuild: bool = False,
    spark: SparkSession | None = None,
    stop: StopRequest | None = None,
    catch_up_turn: threading.Lock | None = None,
    held: Held | None = None,
    *,
    following: bool = False,
) -> RunSummary:
    """Catches the read model up, then (`continuous`) keeps it up until the query stops or
    `stop` asks; a stop lets the batch in flight end (STOP_WAIT_S at most). Readers move to
    a new generation only once it has caught up (`RunSummary.caught_up`); a continuous
    run follows readers to a generation another run switched them to (`following`). The
    catch-up holds `catch_up_turn`, when given, as it runs. The run holds its generation's
    lock unless the caller took it (`held`): while another run holds it, a one-shot run or
    a rebuild is refused (GenerationBusy), and a continuous run waits, a standby that says
    who holds it (its driver started first, to tell whether the read model changed)."""
    stop = stop or StopRequest()
    name = projection.model.name
    _check_reads(settings, projection)
    tables = Tables(settings.projections.warehouse_dir)
    if held is None:
        waiting = None
        changed = None
        if continuous and not rebuild:
            # Not when following: the run that moved readers built the generation from newer
            # code than this one's, likely; building again from this code would move them back
            # (and two drivers of two codes would take turns for ever). This one is refused
            # instead, and its supervisor starts it again with the code there is now.
            if settings.projections.rebuild_changed and not following:
                spark = spark or _driver_session(settings, f"esk-project-{name}")
                changed = partial(_built_otherwise, spark, tables, projection)
            waiting = _Waiting(stop, spark)
        held = hold_generation(tables, name, rebuild, waiting, changed)
    if held is None:  # asked to stop before it held one
        waited = waiting is not None and waiting.waited
        return RunSummary(name, tables.current_generation(name) or 0, standby=waited, started=False)
    # A logger a batch turned off (`_keep`'s refuse_newer) is on again however the run ends:
    # the driver may go on with other runs (esk dev's, or this read model's next generation).
    with held.lock, ExitStack() as on_again:
        spark = spark or _driver_session(settings, f"esk-project-{name}")
        summary = _keep(settings, projection, held, continuous, spark, stop, catch_up_turn, on_again)
    if summary.handed_over:
        again = partial(run, settings, projection, continuous, False, spark, stop, catch_up_turn)
        return _hand_over(tables, name, held.lock.generation, summary, stop, settings.projections.old_generations_kept_s, again)
    offered = summary.taking_over
    if continuous and offered is not None and not stop.asked.is_set():
        lock = tables.run_lock(name, offered)  # its rebuild lets go of it as it offers it
        if _Waiting(stop, spark).take(lock, partial(_moved, tables, name, tables.current_generation(name))):
            tables.withdraw(name, offered)  # after the lock: an offer gone, its lock free, was declined (_hand_over)
            log.info(f"{name}: taking over generation {offered}, rebuilt beside this run: it is brought to where generation "
                     f"{held.lock.generation} stands, then readers move to it")  # fmt: skip
            return _added(run(settings, projection, continuous, False, spark, stop, catch_up_turn, Held(lock, building=True)), summary)
    moved_to = tables.current_generation(name)
    if not continuous or stop.asked.is_set() or moved_to is None or moved_to <= held.lock.generation:
        return summary
    # `esk project run NAME --rebuild` elsewhere (a one-off beside `esk dev`, or a cluster's
    # pod) moved readers to the generation it built, and then ends: this run keeps that one
    # up from now on, once that run has let go of it, or readers would see it stand still.
    log.info(f"{name}: readers were moved to generation {moved_to} by another run: keeping that one up now")
    try:
        then = run(settings, projection, continuous, False, spark, stop, catch_up_turn, following=True)
    except ReadModelChanged as error:
        raise BuiltByOtherCode(
            f"readers were moved to generation {moved_to}, built by other code than this run's ({error.changes}): this run "
            "ends, and started again (as esk dev starts its driver) runs the code as it is then"
        ) from error
    return _added(then, summary)


def _added(then: RunSummary, before: RunSummary) -> RunSummary:
    """A run that went on on another generation: its summary, with what it did before."""
    then.batches += before.batches
    then.events += before.events
    then.rows += before.rows
    return then


def _readers_keeper(tables: Tables, name: str) -> Keeper | None:
    """The run keeping the generation readers use, if one does."""
    current = tables.current_generation(name)
    return None if current is None else tables.run_lock(name, current).keeper()


def _hand_over(
    tables: Tables,
    name: str,
    generation: int,
    summary: RunSummary,
    stop: StopRequest,
    kept_s: float,
    again: Callable[[Held], RunSummary],
) -> RunSummary:
    """A rebuild caught up while another run keeps the generation readers use, and goes on
    writing it: switched now, readers would see rows older than they have seen, by up to
    that run's batch. A continuous run was offered the generation instead (`offer_taken`),
    which brings it to where its own stands, then switches readers; this waits for that
    (HAND_OVER_WAIT_S at most). An offer declined (that run is of other code), not taken in
    that time, or left by a run that ended, ends in this run's switch; so does the end of
    a one-shot run, which takes no offer, once this one has caught up (`again`) with what
    that run wrote."""
    current = tables.current_generation(name)
    offered = tables.offered(name) == generation
    if offered:
        log.info(f"{name}: generation {generation} has caught up; another run keeps generation {current} up, which readers use: "
                 f"it is offered to that run, which brings it to where its own stands, then switches readers")  # fmt: skip
    else:
        log.info(f"{name}: generation {generation} has caught up; a one-shot run writes generation {current}, which readers "
                 f"use: they move once it has ended")  # fmt: skip
    deadline = time.monotonic() + HAND_OVER_WAIT_S
    lock = tables.run_lock(name, generation)
    while not stop.asked.is_set() and time.monotonic() < deadline:
        if (tables.current_generation(name) or 0) >= generation:
            log.info(f"{name}: readers now use generation {generation}, switched by the run that took it over")
            return summary
        if offered and tables.offered(name) != generation and lock.keeper() is None:
            break  # declined, or taken by a run that ended since
        if not offered and _readers_keeper(tables, name) is None:
            break  # the one-shot run ended: nothing writes behind readers' backs now
        stop.asked.wait(HAND_OVER_POLL_S)
    tables.withdraw(name, generation)
    if stop.asked.is_set():
        summary.caught_up = False  # readers stay where they are, unless a run took it over already
        return summary
    try:
        # A look at who keeps it (the API's, `esk project list`) holds the lock for an instant:
        # that is no run taking it over.
        lock.acquire(GRACE_S)
    except GenerationBusy:  # taken over, its catch-up longer than the wait
        log.info(f"{name}: the run that took generation {generation} over switches readers to it once it has caught it up")
        return summary
    if (tables.current_generation(name) or 0) < generation and _behind_readers(tables, name, generation):
        log.info(f"{name}: generation {generation} is behind the one readers use, which a run wrote meanwhile: it catches up "
                 f"again before readers move to it")  # fmt: skip
        return _added(again(Held(lock, building=True)), summary)
    with lock:
        if (tables.current_generation(name) or 0) < generation:
            tables.switch(name, generation)
            log.info(f"{name}: readers now use generation {generation}")
    summary.handed_over = False
    _retire(tables, name, kept_s)
    return summary


def hold_generation(
    tables: Tables, name: str, rebuild: bool, waiting: _Waiting | None = None, changed: Callable[[int], bool] | None = None
) -> Held | None:
    """The generation a run keeps, locked: the one readers use, or a new one (`rebuild`, the
    first, or when `changed` says the one readers use was built by another version of the
    read model). A rebuild's starts over; a first run's goes on from where it stopped.
    While another run holds it, a run is refused (GenerationBusy), or, given `waiting` (a
    continuous run's), waits. Readers may move meanwhile (a rebuild elsewhere
    switching them): then it chooses again, from where they are. None: a stop was asked
    while it waited."""
    while True:
        current = tables.current_generation(name)
        kept = None if rebuild or current is None or (changed is not None and changed(current)) else current
        lock = tables.run_lock(name, (current or 0) + 1 if kept is None else kept)
        if waiting is None:
            lock.acquire(GRACE_S)
        elif not waiting.take(lock, partial(_moved, tables, name, current)):
            if waiting.stop.asked.is_set():
                return None
            continue
        try:
            if tables.current_generation(name) == current:
                if rebuild:
                    # From the earliest offsets, as asked: what a rebuild stopped before its
                    # switch left there (rows and aggregates parked by the code before a fix,
                    # say) goes.
                    tables.withdraw(name, lock.generation)
                    tables.start_over(name, lock.generation)
                return Held(lock, building=lock.generation != current)
        except BaseException:
            lock.release()
            raise
        lock.release()


def _built_otherwise(spark: SparkSession, tables: Tables, projection: Projection, generation: int) -> bool:
    """Whether `generation` was built by another version of the read model (other columns,
    partitioning or version): a continuous run then builds a new one from the earliest
    offsets, as `--rebuild` does, where a one-shot run is refused."""
    model = projection.model
    table = _delta_table(tables.path(model.name, generation))
    if table is None:  # nothing built yet to differ
        return False
    built = _as_built(table, _table_schema(spark, projection), model)
    # built by newer code than this run's: refused, not built back
    if not built.changes or built.version > model.version:
        return False
    log.info(
        f"{model.name}: generation {generation} was built by another version of the read model ({'; '.join(built.changes)}): "
        f"building generation {generation + 1} from the earliest offsets; readers stay on {generation} until it has caught up",
    )
    return True


def _moved(tables: Tables, name: str, current: int | None) -> bool:
    return tables.current_generation(name) != current


@dataclass
class _Waiting:
    """How a continuous run takes its generation: it waits while another run keeps it (a
    rebuild about to end, a one-shot run, another driver), a standby that says who keeps
    it every LOCK_REPORT_EVERY_S, until a stop is asked or readers move."""

    stop: StopRequest
    driver: SparkSession | None = None  # the driver it takes over with, once started
    waited: bool = False  # found the generation kept by another run

    def take(self, lock: GenerationLock, moved: Callable[[], bool]) -> bool:
        """Whether it took `lock`; False when a stop was asked or `moved` first. DriverLost
        when the driver it would take over with is gone: a standby whose JVM died (killed
        for memory, say) waited on, and failed only at the take-over, when it was needed."""
        reported: float | None = None
        while not self.stop.asked.is_set() and not moved():
            if self.driver is not None and not _driver_answers(self.driver):
                raise DriverLost(
                    f"{lock.name}: the Spark driver this run started no longer answers (its JVM ended?) while the run "
                    f"waited for generation {lock.generation}: it ends, to be started again with a driver of its own"
                )
            try:
                return lock.acquire(POLL_S, self.stop.asked)
            except GenerationBusy as busy:
                self.waited = True
                if reported is None or time.monotonic() - reported >= LOCK_REPORT_EVERY_S:
                    log.info(
                        f"{lock.name}: waiting for generation {lock.generation}, which another run keeps ({busy.holder})"
                    )
                    reported = time.monotonic()
        return False


def _keep(
    settings: Settings,
    projection: Projection,
    held: Held,
    continuous: bool,
    spark: SparkSession,
    stop: StopRequest,
    catch_up_turn: threading.Lock | None,
    on_again: ExitStack,
) -> RunSummary:
    """`run`'s work on the generation it holds: it ends when the query does, when `stop`
    asks, or when readers move on to a newer generation. What it turns off for a while,
    `on_again` turns on (the caller's, at the latest as the run ends)."""
    name = projection.model.name
    tables = Tables(settings.projections.warehouse_dir)
    generation = held.lock.generation
    summary = RunSummary(name, generation)
    leaving = threading.Event()  # readers moved on: the query stops as at a stop, and `run` follows

    def moved_on() -> bool:
        if (tables.current_generation(name) or 0) > generation:
            leaving.set()
        return leaving.is_set()

    if moved_on():  # while Spark started: nothing to do here
        summary.caught_up = True
        return summary
    if stop.asked.is_set():
        return summary
    if continuous:  # a rebuild beside it offers it the generation it builds (`_hand_over`)
        held.lock.takes_offers()
    for key, value in DELTA_CONF.items():
        spark.conf.set(key, value)
    spark.conf.set("spark.sql.streaming.stopTimeout", str(int(QUERY_STOP_TIMEOUT_S * 1000)))
    path = tables.path(name, generation)
    schema = _table_schema(spark, projection)
    app_id = f"esk.{settings.app}.{name}.g{generation}"
    writes = _check_plan(spark, projection, app_id, path, schema)
    _create_table(
        spark, path, partial(tables.start_over, name, generation), schema, projection.model, not held.building, writes
    )
    # A continuous run building a generation beside the one readers use (its read model
    # changed) catches up from the earliest offsets: hours, maybe. Holding the catch-up turn
    # all that while would leave the driver's other read models, starting with it, waiting
    # to catch up: it takes the turn a batch at a time, its batches bounded.
    beside = continuous and held.building and tables.current_generation(name) is not None
    catching_up = threading.Event()
    catching_up.set()
    categories = projection.model.categories
    older = older_version(settings, categories)
    newer = newer_version(settings, categories)
    newer_than_code: list[EventsNewerThanCode] = []  # told by the run, not inside Spark's error
    code_fails: list[ReadModelCodeFails] = []  # likewise: what the query's failure was
    parking = tables.parked(name, generation)
    parked = parking.load()
    if parked:  # a fix of the code alone leaves them out: said at each start, where the fix is tried
        log.warning(
            f"{name} g{generation} holds {len(parked)} parked aggregate{'s' if len(parked) != 1 else ''} back "
            f"(`esk project parked {name}`): only a rebuild takes them in again, after a fix (raise the "
            f"ReadModel's version, or `esk project run {name} --rebuild`)"
        )

    def stopping() -> bool:
        return stop.asked.is_set() or leaving.is_set()

    declined: set[int] = set()

    def offer_taken() -> bool:
        """A continuous run keeping readers' generation takes over one a rebuild caught up
        beside it and offered (`_hand_over`): its query stops between batches, as when
        readers move on, and `run` brings the offered one to where this one stands, then
        switches readers: they never see rows older than they have seen. One built by other
        code is declined: it is not this run's to keep (its rebuild switches readers)."""
        offered = tables.offered(name)
        if not continuous or offered is None or offered <= generation or offered in declined:
            return False
        if tables.current_generation(name) != generation:  # readers are not on this one (yet): nothing to go back from
            return False
        table = _delta_table(tables.path(name, offered))
        built = None if table is None else _as_built(table, schema, projection.model, writes)
        if built is None or built.changes or built.writes_changed:
            declined.add(offered)
            tables.withdraw(name, offered)
            told = ("; ".join(built.changes) or "its writes") if built is not None else "no table"
            log.info(f"{name}: generation {offered}, rebuilt beside this run, was built by other code than this run's ({told}): left to its rebuild")
            return False
        summary.taking_over = offered
        leaving.set()
        return True

    def batch(records: DataFrame, batch_id: int) -> None:
        if not (beside and catching_up.is_set()):
            merge_in(records, batch_id)
            return
        with _turn(catch_up_turn, stop) as taken:
            if not taken:  # asked to stop while it waited: the batch runs again at the next start
                raise BatchInterrupted(INTERRUPTED_BY_STOP)
            merge_in(records, batch_id)

    # A batch's events are decoded once, in the read model's own job, while none of another
    # schema version than the code's turns up (`_versions_guard`, which fails the job at
    # one): a batch that holds one is applied again with its versions counted first (its
    # older rows upcast, its newer ones refused), and so is every later batch of the run.
    # Counting them first costs a decode of the batch's every record more (docs/benchmarks.md).
    guard = _versions_guard(older, newer)
    versions_seen = threading.Event()

    def merge_in(records: DataFrame, batch_id: int) -> None:
        started = time.perf_counter()
        # The batch's Kafka records are cached as read, and decoded on each use: the Kafka
        # read runs once a batch, and a cache of the raw values costs next to nothing to
        # build, where one of the decoded rows cost more than the read and the decoding
        # together (docs/benchmarks.md).
        kept = records.persist()
        try:
            if parked or versions_seen.is_set():
                count, rows = counted_first(kept, batch_id)
            else:
                count, rows = guarded(kept, batch_id)
            if (batch_id + 1) % COMPACT_EVERY == 0:
                _compact(name, str(path))
        finally:
            kept.unpersist()
        summary.batches += 1
        summary.events += count
        summary.rows += rows
        log.info(
            f"{name} g{generation} batch {batch_id}: {count:,} events, {rows:,} rows written in {time.perf_counter() - started:.2f}s"
        )

    def writer_for(kept: DataFrame, batch_id: int, count: int) -> BatchWriter:
        on_driver = count <= settings.projections.driver_write_max_events
        # The batch's session, Spark's clone of the run's: the DataFrames a read model writes
        # belong to it, and a write takes its Delta transaction (`BatchWriter.run`) from there.
        return BatchWriter(kept.sparkSession, app_id, batch_id, str(path), on_driver, schema, count)

    def guarded(kept: DataFrame, batch_id: int) -> tuple[int, int]:
        """The batch's events (its records counted undecoded) applied under the guard; once
        more, counted first, when the guard or an event fails it (`counted_first` parks)."""
        count = kept.count()
        if not count:
            return 0, 0
        writer = writer_for(kept, batch_id, count)
        try:
            # Spark's lines about the failed tasks (a stack trace each) are not written: a
            # guard that fails the job is no error, and an event's failure is told in full
            # as the batch fails again, counted first.
            with task_failures_untold(spark):
                return count, apply(decode(kept).filter(guard), writer)
        except Exception as error:
            # Applied again as a batch run again after a crash is: a step the first attempt
            # wrote (its job met no event of another version) is not written twice.
            tripped = VERSIONS_GUARD in str(error)
            if stopping() or not (tripped or _an_events_failure(error)):
                raise
            if tripped:
                log.info(f"{name} g{generation} batch {batch_id} holds events of another schema version than this code's: "
                         f"from now on this run counts each batch's versions first")  # fmt: skip
                versions_seen.set()
        finally:
            writer.release()
        return counted_first(kept, batch_id)

    def counted_first(kept: DataFrame, batch_id: int) -> tuple[int, int]:
        """The batch's events counted first, with those of an older and a newer schema version:
        a batch with older ones is cached once more, upcast, so the upcasting UDF runs once a
        batch; one with newer ones is refused. An event that fails the read model parks its
        aggregate."""
        upcast_kept: DataFrame | None = None
        writer: BatchWriter | None = None
        try:
            decoded = decode(kept)
            if parked:  # before the upcasting too, which may be what fails on them
                decoded = decoded.filter(~held_back(parked))
            count, stale, ahead = _counts(decoded, older, newer)
            if ahead:
                refuse_newer(decoded, batch_id)
            writer = writer_for(kept, batch_id, count)
            try:
                events = decoded
                if stale:
                    upcast_kept = upcast(decoded, settings, categories).persist()
                    upcast_kept.count()
                    events = upcast_kept
                    kept.unpersist()  # the upcast cache is built: it no longer needs this one
                # Spark's lines about a failed task (a JVM stack trace, twice) are not
                # written: an event's failure is told by `park`, in the read model's terms,
                # and any other by the query's failure, traces and all.
                with task_failures_untold(spark, writes=True):
                    return count, apply(events, writer) if count else 0
            except Exception as error:
                if upcast_kept is not None and events is not upcast_kept:
                    # The upcasting failed as its cache was built. Spark would take that cache
                    # for the same plan below, and build it whole, failing, at every probe.
                    upcast_kept.unpersist()
                    upcast_kept = None
                # Probed and written again from the decoded events, upcast anew when the
                # upcasting is what failed: a path a batch seldom takes.
                events = upcast(decoded, settings, categories) if stale else decoded
                newly = park(events, batch_id, writer, error)
                writer.release()
                writer = writer_for(kept, batch_id, count)
                return count, apply(events.filter(~held_back(newly)), writer)
        finally:
            if upcast_kept is not None:
                upcast_kept.unpersist()
            if writer is not None:
                writer.release()

    def refuse_newer(events: DataFrame, batch_id: int) -> None:
        """A batch with events newer than this code fails, and nothing of it is written:
        this code would read them wrongly and leave its rows wrong for good. The run then
        waits for code that knows them (`stand_still`), or fails in a line."""
        found = events.filter(newer).groupBy("aggregate_type", "type", "schema_version").count().collect()
        registry = load_registry(settings.domain)

        def known(aggregate_type: str, type_name: str) -> str:
            try:
                return f"v{registry[aggregate_type].event_type(type_name).schema_version}"
            except UnknownEventType:
                return "no such type"

        told = ", ".join(
            f"{r['aggregate_type']} {r['type']} v{r['schema_version']} ({r['count']:,}; this code knows "
            f"{known(r['aggregate_type'], r['type'])})"
            for r in sorted(found, key=lambda r: (r["aggregate_type"], r["type"], r["schema_version"]))
        )
        newer_than_code.append(EventsNewerThanCode(
            f"{name} g{generation} batch {batch_id} holds events newer than this code knows (a schema version, "
            f"or a type): {told}"
        ))  # fmt: skip
        # The query fails with it, on purpose: Spark's ERROR about that, traces and all, is
        # not written (on again as the run stands still, once the query has ended).
        on_again.callback(loggers_off(spark, (QUERY_FAILURE_LOGGER,)))
        raise newer_than_code[-1]

    def stand_still(refused: EventsNewerThanCode) -> RunSummary:
        """A continuous run's: no query, until a stop (the next start, with the code that
        knows them, takes the batch from there); a one-shot run's failure."""
        on_again.close()
        if not continuous:
            raise EventsNewerThanCode(f"{refused}: run it with the code that wrote them (the domain's release)") from None
        told_at = time.monotonic()
        log.warning(f"{refused}: it stands still until it runs with the code that knows them (release the read models with the domain)")
        held.lock.held_up(f"{refused}: release the read models with the domain")  # for readers: waiting will not do
        summary.held_up, summary.lag = True, {}  # the last batch's lag leaves out the one refused and what came after
        while not stop.asked.wait(POLL_S):
            if time.monotonic() - told_at >= NEWER_REPORT_EVERY_S:
                log.warning(f"{refused}: still standing still, for the code that knows them")
                told_at = time.monotonic()
        return summary

    def apply(events: DataFrame, writer: BatchWriter) -> int:
        if not writer.on_driver:
            with reading(name, projection.model.reads):
                return _rows_written(name, projection.apply(events, writer))
        # One partition, its shuffles too: each partition is a task to schedule, and adaptive
        # execution, which would merge near-empty shuffle partitions, is off in a streaming
        # query's batches.
        with session_conf(events.sparkSession, {"spark.sql.shuffle.partitions": "1"}), reading(name, projection.model.reads):
            return _rows_written(name, projection.apply(events.coalesce(1), writer))

    def park(events: DataFrame, batch_id: int, writer: BatchWriter, error: Exception) -> list[ParkedAggregate]:
        """The aggregates that the batch, failed with `error` (`writer`'s), holds back from
        now on (saved before its write); `error` again when no event is to blame
        (parking.find_parked), or parking is off. Only Spark's failures computing rows are an
        event's: an exception of the read model's own Python code is its code's. Nor is a
        batch of a read model that wrote a step of it already parked: that step holds the
        event, and would not be written again without it."""
        if stopping():
            raise BatchInterrupted(INTERRUPTED_BY_STOP) from error
        kind = _failure_kind(error)
        if not settings.projections.park_failing_events or not writer.events or kind is None or writer.written:
            raise error
        log.warning(f"{name} g{generation} batch {batch_id} failed ({_in_a_line(error)}): looking for the event that fails it"
                    f"{_told_in_full(error)}")

        def fails(part: DataFrame) -> Failure | None:
            """Why `part` fails, as the batch did or as another event's failure (a batch may
            hold events failing in two ways, either told first); None when it does not fail.
            A failure that is no event's (a lost executor, memory) tells nothing of the
            events: the batch fails then."""
            probe = Probe(writer.spark, app_id, batch_id, str(path), writer.on_driver, schema, writer.events)
            try:
                apply(part, probe)
            except PlanEnds:
                return None
            except Exception as failure:
                if stopping():
                    raise BatchInterrupted(INTERRUPTED_BY_STOP) from failure
                its_kind = _failure_kind(failure)
                if its_kind is None or (its_kind != kind and not _an_events_failure(failure)):
                    raise error from failure
                return Failure(_in_a_line(failure), "/".join(filter(None, its_kind)))
            finally:
                probe.release()
            return None

        with task_failures_untold(spark, writes=True):
            newly = find_parked(events, batch_id, fails, parked)
        if not newly:
            if stopping():
                raise BatchInterrupted(INTERRUPTED_BY_STOP) from error
            log.warning(
                f"{name} g{generation} batch {batch_id}: nothing parked: the failure is the read model's code, not one "
                f"aggregate's event (it fails with no event, or on many aggregates' events, or on events of one type over "
                f"and over): fix its code"
            )
            code_fails.append(ReadModelCodeFails(error))
            raise code_fails[-1] from error
        if stopping():
            raise BatchInterrupted(INTERRUPTED_BY_STOP) from error
        parking.add(batch_id, newly)
        parked.extend(newly)
        for p in newly:
            log.warning(
                f"{name} g{generation}: parked {p.aggregate_type} {p.aggregate_id!r}: its {p.event_type} at partition "
                f"{p.partition}, offset {p.offset}, fails the read model ({p.reason}); its events are held back from there "
                "until a rebuild (`esk project parked` lists them)",
            )
        return newly

    def raise_as_told(failure: BaseException) -> None:
        """Raises what the query's `failure` was, as the run tells it, unless it was a batch
        refused for events newer than the code (the run then stands still: `stand_still`),
        or one that the stop asked cut short before the query was stopped (a batch probed
        for its failing event, or waiting for its turn, stops at once): a stop, then."""
        if stopping() and isinstance(failure, CapturedException) and INTERRUPTED_BY_STOP in str(failure):
            return
        if code_fails and isinstance(failure, CapturedException):
            raise code_fails[-1] from failure
        if not newer_than_code:
            raise failure

    def writer() -> DataStreamWriter:
        return (
            event_stream(spark, settings, categories, REBUILD_BESIDE_BATCH_MAX if beside else None)
            .writeStream.foreachBatch(_interruptible(batch, stopping))
            .option("checkpointLocation", str(tables.checkpoint(name, generation)))
        )

    with _turn(None if beside else catch_up_turn, stop) as turn_taken:
        if not turn_taken:  # asked to stop during Spark's start, or while it waited its turn
            return summary

        # A one-shot run tells of an outage; its caller runs it again.
        watched = _WatchedQuery(lambda: writer().trigger(availableNow=True).start(), settings, stop, name, continuous)
        try:
            while watched.goes_on() and not (moved_on() or offer_taken()):
                pass
        except BaseException as failure:  # a caller's Ctrl-C, or the query's failure: no query outlives the run's lock (_stop)
            _stop(watched.query, name)
            raise_as_told(failure)
        if not newer_than_code:
            if watched.failed:  # a stop was asked during an outage
                return summary
            query = watched.query
            stopped = query.isActive
            if stopped:
                try:
                    _stop_between_batches(query, stop, name)
                except CapturedException as failure:  # the batch in flight failed as it ended
                    raise_as_told(failure)
                    if not newer_than_code:  # cut short by the stop: not caught up
                        return summary
    if newer_than_code:  # out of the catch-up turn: the driver's other read models go on meanwhile
        return stand_still(newer_than_code[-1])
    catching_up.clear()
    summary.lag = _lag(query.lastProgress)
    if leaving.is_set():
        summary.caught_up = True  # as far as this generation goes
        return summary
    # A stop that let the last batch end at the newest offsets it saw has caught up too.
    summary.caught_up = not stopped or (query.lastProgress is not None and not any(summary.lag.values()))
    if not summary.caught_up:
        return summary  # readers stay on the generation they use
    keeper = _readers_keeper(tables, name) if held.building and not continuous else None
    if keeper is not None:  # the switch waits for that run (`run`: _hand_over)
        if keeper.takes_offers:
            tables.offer(name, generation)
        summary.handed_over = True
        return summary
    # Caught up to the offsets its catch-up started from, a one-shot rebuild may yet be behind
    # the generation readers use, which a one-shot run wrote meanwhile: readers never move
    # to older rows than they have seen. (A continuous one switches them now: its next batch
    # passes that one's, docs/design.md.)
    if held.building and not continuous and _behind_readers(tables, name, generation):
        log.info(f"{name}: generation {generation} has caught up, behind the one readers use, which a run wrote meanwhile: "
                 f"it catches up again before readers move to it")  # fmt: skip
        return _added(_keep(settings, projection, held, continuous, spark, stop, catch_up_turn, on_again), summary)
    if held.building:
        tables.switch(name, generation)  # caught up: readers move over now, never earlier
        log.info(f"{name}: readers now use generation {generation} ({path})")
    kept_s = settings.projections.old_generations_kept_s
    if not continuous:
        _retire(tables, name, kept_s)
    if continuous and not stop.asked.is_set():
        trigger = f"{settings.projections.trigger_interval_s} seconds"
        watched = _WatchedQuery(lambda: writer().trigger(processingTime=trigger).start(), settings, stop, name, True)
        report_every_s = max(LAG_REPORT_EVERY_S, round(settings.projections.trigger_interval_s * 2))
        reported = vacuumed = retired = time.monotonic()
        retiring = _retire_beside(tables, name, kept_s)
        try:
            try:
                while watched.goes_on() and not (moved_on() or offer_taken()):
                    # A query started again after an outage has no progress yet: no lag to tell.
                    if time.monotonic() - reported > report_every_s and watched.query.lastProgress is not None:
                        lag = _lag(watched.query.lastProgress)
                        if lag != summary.lag:  # a read model that keeps up says so once, not every few seconds
                            log.info(f"{name} lag per partition: {lag or 'none'}")
                        summary.lag = lag
                        reported = time.monotonic()
                    if time.monotonic() - vacuumed > VACUUM_EVERY_S:
                        # Beside the query, not in a batch, so the lag does not wait for it;
                        # Delta lets a VACUUM run alongside writes.
                        _vacuum(name, str(path))
                        vacuumed = time.monotonic()
                    if time.monotonic() - retired > RETIRE_EVERY_S and not retiring.is_alive():
                        retiring = _retire_beside(tables, name, kept_s)
                        retired = time.monotonic()
            except KeyboardInterrupt:  # a caller's Ctrl-C (the CLI's signals only ask)
                pass
            finally:
                if not watched.failed:  # a failed query has nothing to stop
                    _stop_between_batches(watched.query, stop, name)
        except CapturedException as failure:  # a batch failed, the one in flight at a stop included
            raise_as_told(failure)
            if newer_than_code:
                return stand_still(newer_than_code[-1])
        finally:
            if not summary.held_up:
                summary.lag = _lag(watched.query.lastProgress)
    return summary


class ReadModelCodeFails(Exception):
    """A batch failed with `error` on the read model's code, not on one aggregate's event
    (parking found none to blame): the same code fails the same way at every start."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


class RunFailed(Exception):
    """A read model's run (of several in one driver) failed with `error`; `others` are the
    summaries of the read models that stopped because of it."""

    def __init__(self, name: str, error: BaseException, others: Sequence[RunSummary] = ()) -> None:
        if isinstance(error, (GenerationBusy, ReadModelInvalid, BuiltByOtherCode)):
            message = f"{name}: {error}"
        elif isinstance(error, (EventsNewerThanCode, DriverLost)):
            message = str(error)
        elif isinstance(error, ReadModelChanged):
            message = (
                f"{name}: {error}: rebuild that read model alone (`esk project run {name} --rebuild`, or the "
                f"spark-submit job with `{name} --rebuild`), which builds its table again from the events, "
                "as a continuous run (`esk dev`'s among them) does on its own"
            )
        elif _kafka_away(error):
            message = f"{name} failed: no Kafka broker answered ({_kafka_cause(str(error))})"
        else:
            message = f"{name} failed: {_in_a_line(error.error if isinstance(error, ReadModelCodeFails) else error)}"
        super().__init__(message)
        self.name = name
        self.error = error
        self.others = list(others)

    @property
    def told_in_a_line(self) -> bool:
        """Whether its message says all there is: a mistake of the user's or a run's
        situation, not a failure whose traceback the driver's log wants."""
        return isinstance(
            self.error, (GenerationBusy, ReadModelInvalid, BuiltByOtherCode, ReadModelChanged, EventsNewerThanCode, DriverLost)
        )


_WHERE_MAX = 200  # characters of Spark's word on where a batch failed


MALFORMED_RECORD = "MALFORMED_RECORD_IN_PARSING"


def _in_a_line(error: BaseException) -> str:
    """What failed, in a line. A batch's failure comes wrapped in Spark's (the query's, then
    its foreachBatch function's), with the read model's own exception at the end of a
    Python traceback inside: that exception, and where Spark says the query failed."""
    text = str(error).strip()
    traceback = _last_traceback(text)
    if traceback is not None:
        raised = [line for line in traceback.splitlines()[1:] if line and not line[0].isspace()]
        if raised:
            # The first line may point at a stack trace that a line of its own leaves out.
            where = text.splitlines()[0].replace(" Please see the stack trace below.", "")
            if len(where) > _WHERE_MAX:  # cut between words, and said to be cut
                where = where[:_WHERE_MAX].rsplit(" ", 1)[0] + " …"
            return f"{raised[0]} (in a batch: {where})"
    lines = text.splitlines()
    if len(lines) > 1 and lines[0].startswith("An error occurred while calling"):  # py4j's: the Java error follows
        told = _first_line(lines[1].lstrip(": "))
        # A payload's value its field cannot hold (`payload`'s FAILFAST parse): Spark's
        # "malformed record" wraps what it could not read, told in the cause at the end.
        causes = [line.strip().removeprefix("Caused by: ") for line in lines if line.strip().startswith("Caused by: ")]
        return f"{told} ({_first_line(causes[-1])})" if MALFORMED_RECORD in told and causes else told
    return f"{type(error).__name__}: {_first_line(text)}" if lines else type(error).__name__


def _last_traceback(text: str) -> str | None:
    """The last Python traceback in a Spark error's text, to its end (a UDF's exception,
    or the batch function's inside a query's failure); None when it holds none."""
    start = text.rfind("Traceback (most recent call last)")
    return text[start:] if start >= 0 else None


def _told_in_full(error: BaseException) -> str:
    """What a reader of the read model's code needs of a batch's failure beyond its line
    (`_in_a_line`), as the lines after it: a Python UDF's traceback (PySpark keeps the UDF's
    own frames), or the DataFrame call in which Spark says the value failed. Never the JVM's
    stack frames, which name Spark's code alone."""
    text = str(error).strip()
    traceback = _last_traceback(text)
    if traceback is not None:
        return "\n" + traceback
    context = re.search(r"^== (?:DataFrame|SQL\b[^=\n]*) ==$.*?(?=\n\s*\n|\Z)", text, re.M | re.S)
    return "\n" + context.group(0) if context else ""


def _failure_kind(error: BaseException) -> tuple[str, str | None] | None:
    """What kind of Spark failure `error` is (a job's, its Python UDF's, as PySpark raises
    them): its class and Spark's error condition; None for one of Python code on the
    driver."""
    if isinstance(error, Py4JJavaError):
        return "java", str(error.java_exception.getClass().getName())
    if isinstance(error, CapturedException):
        condition = getattr(error, "getCondition", None)
        return type(error).__name__, condition() if callable(condition) else None
    return None


def _an_events_failure(error: Exception) -> bool:
    """Whether `error` is a failure that an event can cause: a SQL error computing a value
    (Spark names its condition: a division by zero, a cast, `raise_error`), a Python UDF's
    exception (an upcaster's), a payload its type cannot hold (`payload`'s FAILFAST parse),
    rather than a lost executor or memory."""
    if isinstance(error, CapturedException):
        condition = getattr(error, "getCondition", None)
        return type(error).__name__ == "PythonException" or (callable(condition) and condition() is not None)
    return isinstance(error, Py4JJavaError) and MALFORMED_RECORD in str(error)


def _first_line(told: str) -> str:
    """A Spark error's first line, without the SQL state and the plan it prints after."""
    return re.sub(r"\s*SQLSTATE: \w+.*", "", told.strip().splitlines()[0]) if told.strip() else ""


def run_several(
    settings: Settings,
    projections: Sequence[Projection],
    continuous: bool = False,
    rebuild: bool = False,
    stop: StopRequest | None = None,
    leave_out_invalid: bool = False,
) -> list[RunSummary]:
    """`run` for each read model, all in one driver: one JVM and its memory, rather than one
    each. Each runs in a thread of its own, on a session of its own: a batch's Delta
    transaction is set in its session's settings (BatchWriter.run), which two read models
    must not share. A run that fails stops the others between batches, and is raised as
    RunFailed once they have stopped: the supervisor restarts them together. With
    `leave_out_invalid`, a read model that cannot run as its code stands (ReadModelInvalid,
    told at its start) or fails in Spark as it runs with nothing to park (ReadModelCodeFails)
    is told and left out while the others go on, and raised as RunFailed once they end: a typo in a new
    read model under `esk dev` would otherwise stop every table until it is fixed, a
    restart changing nothing. Their
    catch-ups take turns, while those caught up keep up: a catch-up's batches are big (its
    cached records, a lookup's broadcast keys), and several at once would share the
    driver's memory for no gain on its few cores."""
    stop = stop or StopRequest()
    catch_up_turn = threading.Lock()
    names = [projection.model.name for projection in projections]
    # A continuous run waits for each generation in its read model's thread; any other is
    # refused at once, before the driver starts, holding none.
    tables = Tables(settings.projections.warehouse_dir)
    held = {} if continuous and not rebuild else _hold_generations(tables, names, rebuild)
    notes: list[GenerationLock] = []  # of the read models left out, held while the others run
    summaries: dict[str, RunSummary] = {}
    failures: list[RunFailed] = []
    left_out: list[RunFailed] = []
    interrupted = False
    try:
        spark = _driver_session(settings, f"esk-project-{'-'.join(names)}" if len(names) <= 3 else "esk-project")

        def one(projection: Projection) -> None:
            name = projection.model.name
            taken = held.pop(name, None)  # `run` lets go of it now
            try:
                summaries[name] = run(settings, projection, continuous, rebuild, spark.newSession(), stop, catch_up_turn, taken)
            except BaseException as error:  # the thread's end: whatever it was, the run failed
                if leave_out_invalid and isinstance(error, (ReadModelInvalid, ReadModelCodeFails)):
                    if taken is not None and isinstance(error, ReadModelInvalid):  # refused before `run` took it over
                        taken.lock.release()
                    told = error if isinstance(error, ReadModelInvalid) else f"failed: {_in_a_line(error.error)}"
                    log.error(f"{name}: {told}; left out of this run, the other read models going on")
                    left_out.append(RunFailed(name, error))
                    _note_left_out(tables.left_out_note(name), str(told), notes)
                    return
                failures.append(RunFailed(name, error))
                stop.asked.set()

        threads = [threading.Thread(target=one, args=(p,), name=f"esk-project-{p.model.name}") for p in projections]
        for thread in threads:
            thread.start()
        while any(thread.is_alive() for thread in threads):
            try:
                for thread in threads:
                    thread.join(POLL_S)  # in steps: the main thread handles signals between them
            except KeyboardInterrupt:  # a caller's Ctrl-C (the CLI's signals only ask): as a signal asks
                (stop.now if stop.asked.is_set() else stop.asked).set()
                interrupted = True
    finally:
        for taken in held.values():  # of runs that never started
            taken.lock.release()
        for note in notes:
            note.release()
    if interrupted:
        raise KeyboardInterrupt
    if failures or left_out:
        failed = (failures or left_out)[0]
        raise RunFailed(failed.name, failed.error, [summaries[name] for name in names if name in summaries])
    return [summaries[name] for name in names]


def _note_left_out(note: GenerationLock, why: str, notes: list[GenerationLock]) -> None:
    """Says for readers, while the driver runs, why it left a read model out; another
    driver that left it out already says so, and a note that cannot be written leaves the
    driver's log alone to say it."""
    try:
        if note.acquire():
            note.held_up(why)
            notes.append(note)
    except (GenerationBusy, OSError) as error:
        log.debug("%s: not noted as left out: %s", note.name, error)


def _hold_generations(tables: Tables, names: Sequence[str], rebuild: bool) -> dict[str, Held]:
    """Each read model's generation, for a run that is refused rather than wait: refused in
    a second, and then holding none."""
    held: dict[str, Held] = {}
    try:
        for name in names:
            taken = hold_generation(tables, name, rebuild)
            if taken is not None:  # (without waiting: refused, or taken)
                held[name] = taken
    except BaseException as error:
        for taken in held.values():
            taken.lock.release()
        if isinstance(error, GenerationBusy):
            raise RunFailed(error.name, error) from None
        raise
    return held


def run_and_report(
    settings: Settings,
    projections: Sequence[Projection],
    continuous: bool,
    rebuild: bool,
    console: Console,
    stop: StopRequest,
    leave_out_invalid: bool = False,
) -> int:
    """What `esk project run` and the spark-submit job do: `run_several`, each read model's
    summary on the console (those that stopped because another failed too, before the
    RunFailed goes up), and the exit code. A one-shot run that stopped before it caught up
    exits 1: a script running `esk project run --rebuild && ...` must not go on as if
    readers had moved to the new generation; a supervisor's stop of a continuous run is its
    end, 0."""
    try:
        summaries = run_several(settings, projections, continuous, rebuild, stop, leave_out_invalid)
    except RunFailed as failed:
        _print_summaries(failed.others, console)
        raise
    _print_summaries(summaries, console)
    return 0 if continuous or all(summary.caught_up for summary in summaries) else 1


def _print_summaries(summaries: Sequence[RunSummary], console: Console) -> None:
    for summary in summaries:
        if not summary.started:
            waited = "while it waited for another run to let go of it" if summary.standby else "before it started"
            console.print(f"{summary.name}: stopped {waited}", highlight=False)
            continue
        # the lag is known once a batch has ended: none is not "lag 0"
        lag = "; held up by events newer than its code" if summary.held_up else f"; lag {sum(summary.lag.values())}" if summary.lag else ""
        console.print(
            f"{summary.name}: generation {summary.generation}, {summary.batches} batches, {summary.events:,} events, "
            f"{summary.rows:,} rows written{lag}",
            highlight=False,
        )
        if not summary.caught_up:
            console.print(f"{summary.name}: stopped before it caught up; readers stay where they were", highlight=False)


def _rows_written(name: str, rows: object) -> int:
    """What a read model's apply returned, once it is the count of rows it wrote."""
    if isinstance(rows, int) and not isinstance(rows, bool):
        return rows
    raise ReadModelMistake(
        f"{name}'s apply returned {type(rows).__name__}, not the rows it wrote: return what its writer's merge or append returns"
    )


class ReadModelInvalid(Exception):
    """The read model cannot run as its code stands: what it reads is not in the domain, or
    its `apply` fails to plan a batch."""


def _check_reads(settings: Settings, projection: Projection) -> None:
    registry = load_registry(settings.domain)
    for aggregate_type in projection.model.reads:
        if aggregate_type.name not in registry:
            raise ReadModelInvalid(
                f"it reads {aggregate_type.name}, which ESK_DOMAIN={settings.domain} does not register: "
                "register it there, or take it out of the ReadModel's reads"
            )


def _table_schema(spark: SparkSession, projection: Projection) -> StructType:
    """The table's columns as the read model declares them, and the columns it orders and
    partitions by among them; ReadModelInvalid, in a line, when not."""
    model = projection.model
    try:
        schema = spark.createDataFrame([], projection.columns).schema
    except AnalysisException as error:  # ParseException among them: a type misspelt
        raise ReadModelInvalid(f"its columns {projection.columns!r} do not parse: {_first_line(error.getMessage())}") from None
    for setting, named in (("order_by", [c.lstrip("-") for c in model.order_by]), ("partition_by", list(model.partition_by))):
        if missing := [c for c in named if c not in schema.names]:
            raise ReadModelInvalid(f"its {setting} names {', '.join(missing)}, which its columns ({', '.join(schema.names)}) do not have")
    return schema


def _check_plan(spark: SparkSession, projection: Projection, app_id: str, path: Path, schema: StructType) -> str | None:
    """The read model's `apply` over no events, with a writer that writes nothing
    (PlanCheck): Spark analyses what it builds, so its mistakes are told now, in a line,
    rather than at its first batch with events, inside the streaming query's error. What
    else fails over no events is left to the batches: the runner never gives `apply` an
    empty batch, so code that assumes rows is no mistake. Returns the fingerprint of its
    writes (PlanCheck.fingerprint); None when its code wants rows to get to them."""
    check = PlanCheck(spark, app_id, -1, str(path), schema=schema)
    try:
        with reading(projection.model.name, projection.model.reads):
            _rows_written(projection.model.name, projection.apply(no_events(spark), check))  # a `return` left out, say
    except (AnalysisException, ReadModelMistake) as error:
        first = _first_line(error.getMessage() if isinstance(error, AnalysisException) else str(error)) or type(error).__name__
        raise ReadModelInvalid(f"its apply, planned over no events at the run's start, fails: {first}") from error
    except PlanEnds:  # a write of its own: what comes after it is not planned
        pass
    except Exception:  # code that wants rows: left to the batches
        return None
    return check.fingerprint()


class ReadModelChanged(Exception):
    """The read model declares other columns (or partitioning, or another version) than its
    table was built with: a batch's rows would not fit it, or the rows already there were
    computed by another version of the read model."""

    def __init__(self, path: Path, changes: str) -> None:
        super().__init__(f"the table at {path} is not what the read model declares ({changes})")
        self.changes = changes


class DriverLost(Exception):
    """The Spark driver a run waits with no longer answers."""


def _driver_answers(spark: SparkSession) -> bool:
    """Whether the driver's JVM runs and its SparkContext too. The JVM PySpark started (local
    mode) is asked first as a process: py4j logs a traceback of its own on a dead gateway."""
    jvm = getattr(spark.sparkContext._gateway, "proc", None)  # none under spark-submit, which started Python
    if jvm is not None and jvm.poll() is not None:
        return False
    try:
        return not spark.sparkContext._jsc.sc().isStopped()
    except Exception:  # py4j's network errors, or a context already torn down (no _jsc)
        return False


class BuiltByOtherCode(Exception):
    """A continuous run followed readers to a generation that another run built from other
    code than its own (a rebuild of newer code): it cannot keep that table up."""


# The table properties that record the ReadModel.version a table was built by (none: 1),
# and the fingerprint of its writes (PlanCheck.fingerprint; none: not known).
VERSION_PROPERTY = "esk.readModel.version"
WRITES_PROPERTY = "esk.readModel.writes"


def _create_table(
    spark: SparkSession,
    path: Path,
    start_over: Callable[[], None],
    schema: StructType,
    model: ReadModel,
    read: bool,
    writes: str | None = None,
) -> None:
    """The generation's table, unless it is there as the read model declares it. A table
    there that knows no fingerprint of its writes (built by esk before they were noted) is
    given this code's."""
    built = _table_fits(path, start_over, schema, model, read, writes)
    if built is not None:
        if writes is not None and built.writes is None:
            spark.sql(f"ALTER TABLE delta.`{path}` SET TBLPROPERTIES ('{WRITES_PROPERTY}' = '{writes}')")
        return
    properties = {**TABLE_PROPERTIES, VERSION_PROPERTY: str(model.version)} | ({WRITES_PROPERTY: writes} if writes else {})
    builder = DeltaTable.createIfNotExists(spark).location(str(path)).addColumns(schema)
    for key, value in properties.items():
        builder = builder.property(key, value)
    if model.partition_by:
        builder = builder.partitionedBy(*model.partition_by)
    builder.execute()


def _table_fits(
    path: Path, start_over: Callable[[], None], schema: StructType, model: ReadModel, read: bool, writes: str | None = None
) -> _Built | None:
    """The table as built, when it is there as the read model declares it; None when there
    is none. When it is there as another: a generation readers use (`read`) is refused,
    naming the changes; one still being built (a first run or a rebuild that stopped before
    readers moved to it) is started over (`start_over`: its table and checkpoint removed; None)."""
    table = _delta_table(path)
    if table is None:
        return None
    built = _as_built(table, schema, model, writes)
    if not built.changes and not built.writes_changed:
        return built
    if read and built.changes:
        raise ReadModelChanged(path, "; ".join(built.changes))
    if read:
        raise ReadModelInvalid(
            f"its writes are not those its table at {path} was built with (a Merge's condition, expressions or columns, "
            f"or its steps), and its version is the same ({model.version}): its rows would be merged one way onto rows "
            f"merged another; raise its ReadModel.version to build it again from the events (or `esk project run "
            f"{model.name} --rebuild`)"
        )
    start_over()
    return None


@dataclass(frozen=True)
class _Built:
    """A table as it was built: the ReadModel.version that built it, how it differs from
    what the read model declares now (nothing: it fits), the fingerprint of the writes that
    built it (None: not recorded), and whether the read model's differ (known only when
    both are)."""

    version: int
    changes: list[str]
    writes: str | None = None
    writes_changed: bool = False


def _as_built(table: Any, schema: StructType, model: ReadModel, writes: str | None = None) -> _Built:
    """The table (delta-rs's, _delta_table) against what `model` declares (its columns
    `schema`, its writes' fingerprint `writes`)."""
    metadata = table.metadata()
    changes = table_changes(json.loads(table.schema().to_json()), metadata.partition_columns, schema, model.partition_by)
    built_by = int(metadata.configuration.get(VERSION_PROPERTY, "1"))
    built_writes = metadata.configuration.get(WRITES_PROPERTY)
    return _Built(
        built_by,
        changes + ([f"version {built_by}, now {model.version}"] if built_by != model.version else []),
        built_writes,
        None not in (writes, built_writes) and writes != built_writes,
    )


def _delta_table(path: Path) -> Any:
    """The Delta table at `path`, read with delta-rs (Spark would rebuild the table's
    snapshot, seconds of a one-shot run on a big table); None when there is none."""
    from deltalake import DeltaTable as DeltaRs

    return DeltaRs(str(path)) if DeltaRs.is_deltatable(str(path)) else None


def table_changes(
    table_schema: dict[str, Any], table_partitions: Sequence[str], declared: StructType, partition_by: Sequence[str]
) -> list[str]:
    """How the declared columns and partitioning differ from a Delta table's (its schema's
    JSON, which is Spark's): by column name and type, nullability and column order aside."""
    held = {f.name: f.dataType.simpleString() for f in StructType.fromJson(table_schema).fields}
    wanted = {f.name: f.dataType.simpleString() for f in declared.fields}
    changes = [f"{name} is new" for name in wanted.keys() - held.keys()]
    changes += [f"{name} is gone" for name in held.keys() - wanted.keys()]
    changes += [f"{name} was {held[name]}, now {wanted[name]}" for name in wanted.keys() & held.keys() if held[name] != wanted[name]]
    if list(table_partitions) != list(partition_by):
        changes.append(f"partitioned by ({', '.join(table_partitions)}), now by ({', '.join(partition_by)})")
    return sorted(changes)


@dataclass
class StopRequest:
    """Asks a run to stop: between batches (`asked`), or at once (`now`)."""

    asked: threading.Event = field(default_factory=threading.Event)
    now: threading.Event = field(default_factory=threading.Event)


def stop_on_signals() -> StopRequest:
    """A stop request that SIGTERM (a supervisor's stop) or SIGINT makes: the first asks
    `run` to stop between batches, the same signal again to stop at once. (By Python's
    default, SIGTERM ends the process in the middle of a batch, its JVM with it.) The other
    signal after the first is the same stop: Ctrl-C in a terminal reaches each process of
    its group, and a supervisor there (`esk dev`) then sends its SIGTERM too. The handlers
    only set events: an exception raised inside a call to the JVM would leave py4j's
    connection waiting for an answer that is never read."""
    stop = StopRequest()
    first: list[int] = []

    def asked(signum: int, _frame: FrameType | None) -> None:
        if first:
            if signum == first[0]:
                set_from_signal_handler(stop.now)
            return
        first.append(signum)
        log.info(f"{signal.Signals(signum).name}: stopping after the batch in flight")
        set_from_signal_handler(stop.asked)

    for stop_signal in (signal.SIGINT, signal.SIGTERM):
        signal.signal(stop_signal, asked)
    return stop


def _await(query: StreamingQuery, stop: StopRequest) -> bool:
    """Waits POLL_S at most for the query to end; whether it goes on (it runs, and no stop
    is asked). Raises what failed the query."""
    if query.isActive and not stop.asked.is_set():
        query.awaitTermination(POLL_S)
    if not query.isActive:
        query.awaitTermination()  # at once; raises if the query failed since the last look
        return False
    return not stop.asked.is_set()


class _WatchedQuery:
    """A run's query, watched: a continuous run's query that a broker outage failed starts
    again in this driver once a broker answers (`_outage_over`), and a batch stalled for
    want of one is told of (`_StalledBatch`)."""

    def __init__(
        self,
        start: Callable[[], StreamingQuery],
        settings: Settings,
        stop: StopRequest,
        name: str,
        outlives_outages: bool,
    ) -> None:
        self._start = start
        self._settings = settings
        self._stop = stop
        self._name = name
        self._outlives_outages = outlives_outages
        self.query = start()
        self.failed = False  # the query failed (and a stop was asked before a broker answered)
        self._stalled = _StalledBatch(settings, name)

    def goes_on(self) -> bool:
        """Waits POLL_S at most for the query; whether it goes on: False once it has ended,
        or a stop is asked. Raises what failed it, unless that was a broker outage that a
        query outliving outages waited out."""
        try:
            if not _await(self.query, self._stop):
                return False
        except CapturedException as error:
            self.failed = True
            if not self._outlives_outages:
                raise
            if not _outage_over(error, self._settings, self._stop, self._name):
                return False
            self.query, self.failed = self._start(), False  # the outage is told
            self._stalled = _StalledBatch(self._settings, self._name)
            return True
        self._stalled.look(self.query)
        return True


# What Spark (StreamExecution.isInterruptionException) reads in a foreachBatch function's
# error as an interruption by the query's stop, which then ends the query quietly. Its
# regex recurses once for each character that follows the match's start: the traceback of
# a batch interrupted in a call to the JVM, which carries the Java stack, overflowed the
# stream thread's stack, and each such stop logged a StackOverflowError.
INTERRUPTED_BY_STOP = "py4j.protocol.Py4JJavaError: An error occurred while calling the batch: java.lang.InterruptedException"
_JAVA_INTERRUPTIONS = {"java.lang.InterruptedException", "java.io.InterruptedIOException", "java.nio.channels.ClosedByInterruptException"}


class EventsNewerThanCode(Exception):
    """A batch holds events of schema versions newer than the run's code knows."""


class BatchInterrupted(Exception):
    """A batch cut short by a stop (`_stop_between_batches`): it runs again at the next start."""


class _NotLoggedWhenInterrupted(logging.Filter):
    """py4j logs every error of a Python function the JVM calls, traceback and all: a batch
    cut short by a stop is not one, nor one refused for events newer than the code (the
    run tells that in a line)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], (BatchInterrupted, EventsNewerThanCode)))


_PY4J_FILTER = _NotLoggedWhenInterrupted()


def _interruptible(batch: Callable[[DataFrame, int], None], stopping: Callable[[], bool]) -> Callable[[DataFrame, int], None]:
    """`batch`, raising BatchInterrupted, with a message Spark reads as a stop, when the stop
    `_stop_between_batches` asked for interrupts it (in a call to the JVM): a query that is
    behind starts its next batch before the stop lands, and a stop at once or STOP_WAIT_S
    interrupts the one in flight."""
    logging.getLogger("py4j.clientserver").addFilter(_PY4J_FILTER)

    def interruptible(records: DataFrame, batch_id: int) -> None:
        try:
            batch(records, batch_id)
        except (Py4JJavaError, CapturedException) as error:
            if stopping() and _interruption(error):
                raise BatchInterrupted(INTERRUPTED_BY_STOP) from None  # `from None`: no Java stack in the message
            raise

    return interruptible


def _interruption(error: Py4JJavaError | CapturedException) -> bool:
    """Whether the JVM's error is an interruption (the thread's, or its job's cancellation),
    as Spark tells them apart. PySpark raises some of the JVM's errors as exceptions of its
    own, which keep the Java one as `_origin`."""
    cause = error.java_exception if isinstance(error, Py4JJavaError) else getattr(error, "_origin", None)
    while cause is not None:
        name = cause.getClass().getName()
        if name in _JAVA_INTERRUPTIONS or (name == "org.apache.spark.SparkException" and "cancelled" in str(cause.getMessage())):
            return True
        cause = cause.getCause()
    return False


def _driver_session(settings: Settings, app_name: str) -> SparkSession:
    """The run's session, SIGINT's handler left as it was: a SparkContext made in the main
    thread sets its own, which cancels every job and raises KeyboardInterrupt, and Ctrl-C
    then cut the batches in flight short instead of asking the run to stop
    (stop_on_signals)."""
    before = signal.getsignal(signal.SIGINT)
    try:
        return spark_session(settings, app_name)
    finally:
        if threading.current_thread() is threading.main_thread() and before is not None:
            signal.signal(signal.SIGINT, before)


@contextmanager
def _turn(lock: threading.Lock | None, stop: StopRequest) -> Iterator[bool]:
    """Holds `lock` (when given) for the block; False, holding nothing, when a stop was
    asked before it was taken."""
    while not stop.asked.is_set():
        if lock is None or lock.acquire(timeout=POLL_S):
            try:
                yield True
            finally:
                if lock is not None:
                    lock.release()
            return
    yield False


# What a Kafka client in Spark raises when no broker answered within its timeouts.
_KAFKA_AWAY = re.compile(r"org\.apache\.kafka\.common\.errors\.(TimeoutException|DisconnectException|NetworkException)")


def _kafka_away(error: BaseException) -> bool:
    return bool(_KAFKA_AWAY.search(str(error)))


def _kafka_cause(told: str) -> str:
    """The Kafka client's own line in a query's failure: a batch that failed reading its
    records reports it deep in a Python traceback, under a first line that blames the read
    model's function."""
    found = _KAFKA_AWAY.search(told)
    if found is None:
        return _first_line(told)
    return told[found.start() :].splitlines()[0].removeprefix("org.apache.kafka.common.errors.")


def _outage_over(error: CapturedException, settings: Settings, stop: StopRequest, name: str) -> bool:
    """A continuous run's query gives up when its broker stays away for a few of its request
    timeouts: it starts again from its checkpoint once one answers (True), in this driver,
    rather than end the run and have a supervisor start a cold one. False: a stop was asked
    meanwhile. Raises `error` when it is not a broker away."""
    if not _kafka_away(error):
        raise error
    log.warning(f"{name}: no Kafka broker answered ({_kafka_cause(str(error))}): it goes on once one does")
    if not _until_kafka_answers(settings, stop):
        return False
    log.info(f"{name}: Kafka answers again: going on")
    return True


def _until_kafka_answers(settings: Settings, stop: StopRequest) -> bool:
    """Waits until a broker answers (True), or a stop is asked (False)."""
    while not stop.asked.is_set():
        if _broker_answers(settings):
            return True
        stop.asked.wait(POLL_S)
    return False


def _broker_answers(settings: Settings) -> bool:
    try:
        return asyncio.run(asyncio.wait_for(check_access(settings), KAFKA_CHECK_S))
    except TimeoutError:  # a host that drops packets: a stop is still seen within seconds
        return False
    except KafkaAccessError:  # refused (TLS, SASL): told once more by the query's next failure
        return True


class _StalledBatch:
    """Says once when a batch has been in flight STALL_CHECK_S and no broker answers, and
    once when it has ended: the query itself says nothing until its Kafka requests have
    retried for as long as their timeouts allow, minutes later, or until the broker is back."""

    def __init__(self, settings: Settings, name: str) -> None:
        self.settings = settings
        self.name = name
        self._finished: int | None = None  # the query's last finished batch, as last seen
        self._since = self._checked = time.monotonic()
        self._told = False

    def look(self, query: StreamingQuery) -> None:
        now = time.monotonic()
        finished = _batch_id(query)
        if finished != self._finished or not query.status["isTriggerActive"]:
            if self._told:  # a trigger with no events to read ends with no batch: told all the same
                log.info(f"{self.name}: Kafka answers again" + (": the batch went through" if finished != self._finished else ""))
            self._finished, self._since, self._told = finished, now, False
            return
        if self._told or now - self._since < STALL_CHECK_S or now - self._checked < STALL_CHECK_S:
            return
        self._checked = now
        if not _broker_answers(self.settings):
            self._told = True
            log.warning(
                f"{self.name}: a batch has waited {now - self._since:.0f}s and no Kafka broker answers: it goes on once one does"
            )


def _stop_between_batches(query: StreamingQuery, stop: StopRequest, name: str, wait_s: float = STOP_WAIT_S) -> None:
    """Stops the query once the batch in flight has ended (and committed its offsets), or at
    once when `stop.now` is set or after `wait_s`: a batch stopped midway is work thrown
    away, to be done again. Waits for that batch, not for a pause between batches, which a
    query that is behind never makes."""
    in_flight = _batch_id(query)
    deadline = time.monotonic() + wait_s

    def running() -> bool:
        status = query.status
        # A trigger still asking Kafka for offsets has done nothing to lose (and with the
        # broker away, it would ask for all of wait_s).
        getting_offsets = str(status["message"]).startswith("Getting offsets")
        return query.isActive and bool(status["isTriggerActive"]) and not getting_offsets and _batch_id(query) == in_flight

    ended = False
    try:
        while not (ended := not running()) and not stop.now.is_set() and time.monotonic() < deadline:
            time.sleep(0.1)
    except KeyboardInterrupt:  # a caller's second Ctrl-C
        pass
    # A query that is behind has started its next batch by now: the stop cuts that one short
    # at its start, and it runs again at the next start, as one cut short here does.
    _stop(query, name)
    if not ended:
        log.warning(f"{name}: stopped in the middle of a batch; it runs again at the next start")
    failure = query.exception()  # a batch that failed meanwhile, not one the stop cut short
    if failure is not None:
        raise failure


def _stop(query: StreamingQuery, name: str) -> None:
    """Stops the query, or leaves it after QUERY_STOP_TIMEOUT_S: its batches are idempotent
    (Delta's transaction ids), so one that ends after the run's lock was let go is harmless."""
    try:
        query.stop()
    except (Py4JJavaError, CapturedException) as error:
        if "failed to stop within" not in str(error):
            raise
        log.warning(
            f"{name}: the query did not stop within {QUERY_STOP_TIMEOUT_S:.0f}s (its thread still in a call, a Kafka request or a "
            "write): the run ends without it, and a batch it may still finish is written once, as at a restart",
        )


def _batch_id(query: StreamingQuery) -> int | None:
    """The id of the last batch the query finished (None before its first)."""
    progress = query.lastProgress
    return None if progress is None else int(progress["batchId"])


def _vacuum(name: str, path: str) -> None:
    """Removes the files no table version within the table's retention refers to; a failure
    is told (`_upkeep`)."""
    from deltalake import DeltaTable as DeltaRs

    with _upkeep(name, "removing the files its table no longer refers to"):
        DeltaRs(path).vacuum(dry_run=False)


@contextmanager
def _upkeep(name: str, what: str) -> Iterator[None]:
    """A Delta upkeep step whose failure (a commit beside it, a file store that refused) is
    told, not raised: it can wait until its next turn, where a run ended by it would leave
    the read model unkept, or a batch failed by it would be probed for an event to blame."""
    try:
        yield
    except Exception as error:
        log.warning(f"{name}: {what} failed (tried again later): {error!r}")


def _retire(tables: Tables, name: str, kept_s: float) -> None:
    """Removes the generations readers left `kept_s` ago (Tables.retire). A failure is
    told, not raised: the run goes on, and the next look tries again."""
    try:
        removed = tables.retire(name, kept_s)
    except OSError as error:
        log.warning(f"{name}: a generation readers left could not be removed (tried again later): {error}")
        return
    if removed:
        log.info(f"{name}: removed generation(s) {', '.join(map(str, removed))}, which readers left")


def _retire_beside(tables: Tables, name: str, kept_s: float) -> threading.Thread:
    """`_retire` in a thread of its own, beside a continuous run's loop: removing a big
    table from a network share can take minutes, in which the loop would not see a stop."""
    thread = threading.Thread(target=_retire, args=(tables, name, kept_s), name=f"esk-retire-{name}", daemon=True)
    thread.start()
    return thread


def _behind_readers(tables: Tables, name: str, generation: int) -> bool:
    """Whether `generation` reflects less of a partition it reads than the generation readers
    use (which may read others: its read model's categories were others)."""
    theirs = read_model_positions(tables, name)
    if theirs is None or tables.current_generation(name) == generation:
        return False
    mine = checkpoint_positions(tables.checkpoint(name, generation))
    return any(offset > mine[key] for key, offset in theirs.items() if key in mine)


def _compact(name: str, path: str) -> None:
    """Rewrites the table's small files into fewer; a failure is told (`_upkeep`)."""
    from deltalake import DeltaTable

    with _upkeep(name, "compacting its table's small files"):
        DeltaTable(path).optimize.compact()


def _versions_guard(older: Column | None, newer: Column) -> Column:
    """A filter true on every event of the code's own schema version, that fails the job at
    one of an older or a newer version (VERSIONS_GUARD in its error)."""
    other = newer if older is None else older | newer
    # Kept apart from the read model's own filters by a condition Spark's optimizer cannot
    # see through (always true): merged with `filter(is_event(T, E))`, it had E's type put
    # in as a constant, and tripped on the other types' events as of E's version.
    return F.when((F.spark_partition_id() >= 0) & other, F.raise_error(F.lit(VERSIONS_GUARD))).otherwise(F.lit(True))


def _counts(events: DataFrame, older: Column | None, newer: Column) -> tuple[int, int, int]:
    """The batch's events, those of an older schema version and those of a newer one, in
    one pass."""
    row = events.agg(F.count(F.lit(1)), F.count_if(older) if older is not None else F.lit(0), F.count_if(newer)).first()
    assert row is not None, "an aggregate without grouping has one row"
    return int(row[0]), int(row[1]), int(row[2])


def _lag(progress: dict[str, Any] | None) -> dict[str, int]:
    """Records between what was processed and the newest offsets, per topic partition."""
    if not progress:
        return {}
    lag: dict[str, int] = {}
    for source in progress.get("sources", []):
        end, latest = _offsets(source.get("endOffset")), _offsets(source.get("latestOffset"))
        for key, offset in latest.items():
            lag[key] = max(offset - end.get(key, 0), 0)
    return lag


def _offsets(raw: object) -> dict[str, int]:
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except ValueError:  # a source that has no offsets yet reports none
            return {}
    data = raw if isinstance(raw, dict) else {}
    return {f"{topic}[{p}]": int(o) for topic, parts in data.items() for p, o in parts.items()}
