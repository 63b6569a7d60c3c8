"""Rebuilds stored aggregate states whose state model has changed, from their events.

Each stored state records the shape of the state model that wrote it
(`AggregateType.state_shape`). When a partition starts with states of another shape (a
release changed the model), they are folded again from the events, which are the source
of truth and kept forever: the partition's events of each aggregate type are read once,
read_committed, up to their end; only the events of stale aggregates are decoded (upcast
on the way, as any reader's are) and folded; every new state is written through the
changelog like any other change, in transactions of `REBUILD_BATCH` states. Only then does
the partition handle commands.

A crash in the middle loses nothing and applies nothing twice: a state is always folded
from the aggregate's first event, and the states already written carry the new shape, so
the next start rebuilds only the rest. An aggregate whose events cannot be folded (a bug
in `evolve`, a missing event) keeps its old state, marked unusable with the reason: its
commands are refused naming that reason, the others go on, and the next start tries it
again (with the fixed code).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
from aiokafka import AIOKafkaConsumer, TopicPartition
from pydantic import BaseModel, ValidationError

from ..domain.aggregate import one_line
from ..kafka.reader import read_committed
from ..kafka.stopping import stop_consumer
from ..kafka.topics import TopicNames
from ..metrics import REBUILD_EVENTS, REBUILT_AGGREGATES, UNUSABLE_AGGREGATES
from ..protocol import AGGREGATE_PREFIX, EventRecord, StoredAggregate, aggregate_key, position
from ..registry import Registry
from ..settings import Settings
from ..state.restore import RestoreProgress
from .stream_task import StreamTask

log = logging.getLogger(__name__)

REBUILD_BATCH = 1000  # states per transaction
FETCH_RECORDS = 10_000


@dataclass
class _Fold:
    """One stale aggregate's state as its events are folded again."""

    stored: StoredAggregate
    state: BaseModel | None = None
    version: int = 0
    recorded_at: int = 0
    error: str | None = None


@dataclass
class RebuildReport:
    rebuilt: int = 0
    unusable: dict[bytes, str] = field(default_factory=dict)  # store key -> reason


async def rebuild_stale_states(
    task: StreamTask,
    reader: Callable[[], AIOKafkaConsumer],
    commit: Callable[[], Awaitable[None]],
    on_progress: Callable[[RestoreProgress], None],
) -> RebuildReport:
    """Fold again every stored state of `task`'s partition whose shape is not its type's
    current one, reading events with a `reader()` (read_committed, no group); `commit`
    commits what the task has written so far (one transaction)."""
    stale = task.stale_aggregates()
    if not stale:
        return RebuildReport()
    consumer = reader()
    await consumer.start()
    try:
        return await _rebuild(task, stale, consumer, commit, on_progress)
    finally:
        await stop_consumer(consumer)


async def _rebuild(
    task: StreamTask,
    stale: dict[tuple[str, str], StoredAggregate],
    reader: AIOKafkaConsumer,
    commit: Callable[[], Awaitable[None]],
    on_progress: Callable[[RestoreProgress], None],
) -> RebuildReport:
    report = RebuildReport()
    log.info("partition %d: %d aggregate states of an older shape; rebuilding them from their events", task.partition, len(stale))
    by_type: dict[str, dict[str, _Fold]] = {}
    for (aggregate_type, aggregate_id), stored in stale.items():
        by_type.setdefault(aggregate_type, {})[aggregate_id] = _Fold(stored)
    progress = RestoreProgress(task.partition, what="rebuilding")
    tps = {TopicPartition(task.topics.events(name), task.partition): name for name in by_type}
    reader.assign(list(tps))
    beginnings = await reader.beginning_offsets(list(tps))
    ends = await reader.end_offsets(list(tps))
    progress.end_offset = sum(ends[tp] - beginnings[tp] for tp in tps)
    for tp in tps:
        reader.seek(tp, beginnings[tp])
    pending = {tp for tp in tps if ends[tp] > beginnings[tp]}
    while pending:
        fetched = await reader.getmany(*pending, timeout_ms=500, max_records=FETCH_RECORDS)
        for tp, records in fetched.items():
            _fold_records(task.registry, tps[tp], by_type[tps[tp]], records)
            progress.restored += len(records)
        for tp in list(pending):
            if await reader.position(tp) >= ends[tp]:
                pending.discard(tp)
        on_progress(progress)
    written = 0
    for aggregate_type, folds in by_type.items():
        for aggregate_id, fold in folds.items():
            reason = _write(task, aggregate_type, aggregate_id, fold)
            if reason is None:
                report.rebuilt += 1
            else:
                report.unusable[aggregate_key(aggregate_type, aggregate_id)] = reason
            written += 1
            if written % REBUILD_BATCH == 0:
                await commit()
    await commit()
    progress.finished = time.monotonic()
    on_progress(progress)
    REBUILT_AGGREGATES.inc(report.rebuilt)
    REBUILD_EVENTS.inc(progress.restored)
    UNUSABLE_AGGREGATES.labels(str(task.partition)).set(len(report.unusable))
    log.info(
        "partition %d: rebuilt %d states from %d events at %.0f events/s; %d unusable",
        task.partition, report.rebuilt, progress.restored, progress.rate, len(report.unusable),
    )
    for key, reason in report.unusable.items():
        log.error("partition %d: %s is unusable: %s", task.partition, key[len(AGGREGATE_PREFIX):].decode(errors="replace"), reason)
    return report


def _fold_records(registry: Registry, aggregate_type: str, folds: dict[str, _Fold], records: list[Any]) -> None:
    """Fold the records of stale aggregates; the others are passed over undecoded."""
    definition = registry[aggregate_type]
    for record in records:
        fold = folds.get(record.key.decode()) if record.key is not None else None
        if fold is None or fold.error is not None:
            continue
        at = f"at {position(record.topic, record.partition, record.offset)}"
        try:
            event = EventRecord.decode(record.value)
            if event.version != fold.version + 1:
                raise ValueError(f"event version {event.version} follows version {fold.version}")
        except Exception as error:  # a record not decodable: it must not stop the partition (G8)
            fold.error = f"its event {at}: {one_line(error)}"
            continue
        what = f"its {event.type} v{event.schema_version} event {at}"
        try:
            model = definition.known_event_type(event.type, event.schema_version)
            payload = definition.upcast(event.type, event.schema_version, event.data)
        except Exception as error:  # an unknown type, a version the code does not know, an upcaster's bug
            fold.error = f"{what}: {one_line(error)}"
            continue
        try:
            data = model.model_validate(payload)
        except ValidationError as error:
            fold.error = (
                f"{what} does not fit the event as the code has it ({one_line(error)}): "
                "a changed event needs a new schema_version and an upcaster (esk schema check)"
            )
            continue
        try:
            fold.state = definition.fold([data], fold.state)  # (which tells an evolve that returned no state)
        except Exception as error:  # a bug in evolve
            fold.error = f"evolve failed on {what}: {one_line(error)}"
            continue
        fold.version, fold.recorded_at = event.version, event.recorded_at


def _write(task: StreamTask, aggregate_type: str, aggregate_id: str, fold: _Fold) -> str | None:
    """Write the folded state, or mark the aggregate unusable; returns the reason if so."""
    stored, definition = fold.stored, task.registry[aggregate_type]
    reason = fold.error
    if reason is None and fold.version != stored.version:
        reason = f"its events reach version {fold.version}, its state is at version {stored.version}"
    if reason is None and fold.state is not None:
        task.replace_state(
            aggregate_type,
            aggregate_id,
            StoredAggregate(
                version=stored.version,
                state=fold.state.model_dump(mode="json"),
                updated_at=fold.recorded_at,
                expires_at=definition.expires_at(fold.state, fold.recorded_at),
                shape=definition.state_shape,
            ),
            previous=stored,
        )
        return None
    reason = reason or "its events fold to no state"
    if stored.unusable != reason:
        task.replace_state(aggregate_type, aggregate_id, msgspec.structs.replace(stored, unusable=reason), previous=stored)
    return reason


async def unusable_aggregates(settings: Settings) -> dict[tuple[str, str], str]:
    """Every aggregate marked unusable, by (aggregate type, id), with the reason: read from
    the changelog (the latest record of each key), so it needs no processor."""
    latest: dict[bytes, bytes | None] = {}
    for record in await read_committed(settings, TopicNames(settings.app).changelog):
        if record.key is not None and record.key.startswith(AGGREGATE_PREFIX):
            latest[record.key] = record.value
    found: dict[tuple[str, str], str] = {}
    for key, value in latest.items():
        stored = StoredAggregate.decode(value) if value is not None else None
        if stored is not None and stored.unusable is not None:
            aggregate_type, _, aggregate_id = key[len(AGGREGATE_PREFIX):].decode().partition("/")
            found[aggregate_type, aggregate_id] = stored.unusable
    return found
