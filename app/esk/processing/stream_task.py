"""StreamTask: handles the commands of one partition, one at a time, in order.

Each command is checked against the task's store (a retry answers with its first outcome),
handled by `command_handler.handle_command` against the aggregate's state as the Overlay
shows it, and its outputs (events, outcome, changelog records) go into the open Batch. The
task never writes to Kafka itself: the TaskManager seals the open batch, commits it in one
transaction through the partition's StreamsProducer, and hands it back with `committed`,
and only then does the task write its store, data and changelog offset in one batch.

The position is a changelog record too (`p/<partition>`: the next commands offset), added
when a batch is sealed, so a restored store knows where its commands resume.

While a sealed batch's transaction is in flight, the next batch is being handled: reads see
both (the Overlay's two layers).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from aiokafka import TopicPartition
from aiokafka.structs import ConsumerRecord
from opentelemetry.trace import SpanKind

from .. import tracing
from ..kafka.topics import TopicNames
from ..metrics import COMMANDS, DLQ_RECORDS
from ..protocol import (
    AGGREGATE_END,
    AGGREGATE_PREFIX,
    EXPIRY_PREFIX,
    UNKNOWN_AGGREGATE_TYPE,
    CommandEnvelope,
    DecodeError,
    Outcome,
    Status,
    StoredAggregate,
    aggregate_key,
    command_key,
    expires_at_header,
    expiry_bound,
    expiry_key,
    now_ms,
    parse_expiry_key,
    position,
    position_key,
)
from ..registry import Registry
from ..state.store import StateStore
from .command_handler import handle_command, refusal
from .overlay import ABSENT, Overlay, Writes
from .record_collector import Headers, Output

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Batch:
    """What the commands from `start_offset` on have handled, not yet in Kafka. Sealed, it
    also has its store writes and the position it ends at (the next commands offset)."""

    start_offset: int
    outputs: list[Output] = field(default_factory=list)
    started: float | None = None  # monotonic time of its first output
    writes: Writes = field(default_factory=dict)
    end_offset: int = 0


class StreamTask:
    def __init__(
        self,
        partition: int,
        topics: TopicNames,
        registry: Registry,
        store: StateStore,
        next_offset: int,
        dedup_window_ms: int,
        traced: bool = False,
    ) -> None:
        self.partition = partition
        self.topics = topics
        self.registry = registry
        self.store = store
        self.overlay = Overlay(store)
        self.input = TopicPartition(topics.commands, partition)
        self.next_offset = next_offset  # the next commands offset this task has to handle
        self.committed_offset = next_offset  # the position the last committed transaction recorded
        self.dedup_window_ms = dedup_window_ms
        self._open = Batch(next_offset)
        self._counted: Counter[tuple[str, str]] = Counter()  # commands by (type, outcome), for COMMANDS
        self._traced = traced

    # -- handling ----------------------------------------------------------------

    @property
    def has_pending(self) -> bool:
        """The open batch has something to commit."""
        return self.next_offset > self._open.start_offset or bool(self._open.outputs)

    @property
    def pending_commands(self) -> int:
        return self.next_offset - self._open.start_offset

    def batch_age(self) -> float:
        started = self._open.started
        return 0.0 if started is None else time.monotonic() - started

    def process(self, records: Sequence[ConsumerRecord[bytes, bytes]]) -> None:
        """Handle `records` in order. The store values they read are fetched first, in one
        multi-get rather than one get per key. Nothing here awaits (see Overlay.fetch)."""
        handled: list[tuple[ConsumerRecord[bytes, bytes], CommandEnvelope | DecodeError, bytes, bytes]] = []
        wanted: list[bytes] = []
        next_offset = self.next_offset
        for record in records:
            if record.offset < next_offset:
                continue  # fetched before a rewind; handled already
            next_offset = record.offset + 1
            try:
                envelope = CommandEnvelope.decode(record.value)
            except DecodeError as error:
                handled.append((record, error, b"", b""))
                continue
            keys = command_key(envelope.command_id), aggregate_key(envelope.aggregate_type, envelope.aggregate_id)
            handled.append((record, envelope, *keys))
            wanted += keys
        self.overlay.fetch(wanted)
        handle = self._handle_traced if self._traced else self._handle
        try:
            for record, decoded, command_store_key, aggregate_store_key in handled:
                self.next_offset = record.offset + 1
                if isinstance(decoded, DecodeError):
                    self._dead_letter(record, str(decoded))
                else:
                    handle(record, decoded, command_store_key, aggregate_store_key)
        finally:
            self.overlay.forget_fetched()
            # one increment per kind and chunk: `labels()` and `inc()` each take a lock
            for (aggregate_type, outcome), count in self._counted.items():
                COMMANDS.labels(aggregate_type, outcome).inc(count)
            self._counted.clear()

    def _handle_traced(
        self,
        record: ConsumerRecord[bytes, bytes],
        envelope: CommandEnvelope,
        command_store_key: bytes,
        aggregate_store_key: bytes,
    ) -> None:
        # A child of the context the command record carries (the HTTP request's, or the
        # reactor's that sent it); its own context goes onto the events and the outcome.
        with tracing.TRACER.start_as_current_span(
            f"handle {envelope.aggregate_type}.{envelope.command}",
            context=tracing.context_of(record.headers),
            kind=SpanKind.CONSUMER,
            attributes={
                **tracing.command_attributes(envelope, record.topic),
                "messaging.operation.type": "process",
                "messaging.destination.partition.id": str(record.partition),
                "messaging.kafka.offset": record.offset,
            },
        ) as span:
            result = self._handle(record, envelope, command_store_key, aggregate_store_key, tracing.headers_for(span))
            if isinstance(result, Outcome):
                span.set_attribute("esk.command.outcome", result.status.value)
                if result.code is not None:
                    span.set_attribute("esk.command.code", result.code)
            else:
                span.set_attribute("esk.command.outcome", result)

    def _handle(
        self,
        record: ConsumerRecord[bytes, bytes],
        envelope: CommandEnvelope,
        command_store_key: bytes,
        aggregate_store_key: bytes,
        trace: Headers | None = None,
    ) -> Outcome | str:
        """Handle one command; `trace`: the headers that carry its handling's trace context
        (None: not traced). Returns its outcome, or what else became of it."""
        record_key = envelope.key  # the aggregate's: its events and outcomes carry it too
        if record.key != record_key:
            # Ordering (G1) rests on every command of an aggregate sharing a partition.
            self._dead_letter(record, f"record key {record.key!r} does not match aggregate {record_key!r}")
            return "dead_letter"
        previous = self.overlay.get(command_store_key)
        if previous is not None:
            # A retry: answer with the original outcome, change nothing (G3).
            self._emit(self.topics.results, record_key, previous, headers=trace)
            self._counted[envelope.aggregate_type, "duplicate"] += 1
            return "duplicate"
        aggregate_type = self.registry.get(envelope.aggregate_type)
        if aggregate_type is None:
            detail = f"no aggregate type {envelope.aggregate_type!r}"
            outcome = refusal(envelope, Status.REJECTED, UNKNOWN_AGGREGATE_TYPE, detail, 0, now_ms())
            self._record_outcome(outcome, command_store_key, record_key, trace)
            return outcome
        raw = self.overlay.get(aggregate_store_key)
        stored = StoredAggregate.decode(raw) if raw is not None else None
        handled = handle_command(aggregate_type, envelope, stored, now_ms())
        events_topic = self.topics.events(envelope.aggregate_type)
        for event in handled.events:
            headers = event.headers()
            if trace:
                headers += trace
            self._emit(events_topic, record_key, event.encode(), headers=headers)
        if handled.aggregate is not None:
            self._store_aggregate(aggregate_store_key, handled.aggregate, stored)
        self._record_outcome(handled.outcome, command_store_key, record_key, trace)
        return handled.outcome

    def _store_aggregate(self, key: bytes, aggregate: StoredAggregate, previous: StoredAggregate | None) -> None:
        self._change(key, aggregate.encode(), aggregate.expires_at)
        expires_before = previous.expires_at if previous is not None else None
        if expires_before is not None and expires_before != aggregate.expires_at:
            self._index(expiry_key(expires_before, key), None)

    # -- state rebuilds (state_rebuild.py) -------------------------------------------------

    def stale_aggregates(self) -> dict[tuple[str, str], StoredAggregate]:
        """The stored states that their type's current model did not write, or that were
        found unusable, by (aggregate type, aggregate id). Aggregates of types that are no
        longer registered are left alone."""
        stale: dict[tuple[str, str], StoredAggregate] = {}
        for key, value in self.store.scan(AGGREGATE_PREFIX, AGGREGATE_END):
            aggregate_type, _, aggregate_id = key[len(AGGREGATE_PREFIX):].decode().partition("/")
            definition = self.registry.get(aggregate_type)
            if definition is None:
                continue
            stored = StoredAggregate.decode(value)
            if stored.shape != definition.state_shape or stored.unusable is not None:
                stale[aggregate_type, aggregate_id] = stored
        return stale

    def replace_state(self, aggregate_type: str, aggregate_id: str, aggregate: StoredAggregate, previous: StoredAggregate) -> None:
        """Write a rebuilt (or unusable) state: through the changelog, like any change."""
        self._store_aggregate(aggregate_key(aggregate_type, aggregate_id), aggregate, previous)

    def _record_outcome(self, outcome: Outcome, command_store_key: bytes, record_key: bytes, trace: Headers | None = None) -> None:
        """`command_store_key`: where the outcome answers retries; `record_key`: the
        aggregate's record key, which the outcome is published under, with `trace`'s
        headers (a reactor's outcome handler continues the trace)."""
        value = outcome.encode()
        self._emit(self.topics.results, record_key, value, headers=trace)
        self._change(command_store_key, value, expires_at=outcome.processed_at + self.dedup_window_ms)
        self._counted[outcome.aggregate_type, outcome.code or outcome.status.value] += 1

    def expire(self, now: int, limit: int) -> int:
        """Delete what expired before `now` (final aggregates past their retention,
        de-duplication entries past the window), at most `limit` of them. The deletes are
        tombstones in the changelog, committed with the next batch, so a restore never
        resurrects them and compaction drops them from the topic too."""
        expired = 0
        for index_key, _ in self.store.scan(EXPIRY_PREFIX, expiry_bound(now)):
            if expired >= limit:
                break
            if self.overlay.pending(index_key) is not ABSENT:
                continue  # deleted in a batch not yet in the store
            expires_at, key = parse_expiry_key(index_key)
            current = self.overlay.get(key)
            if current is not None and not (
                key.startswith(AGGREGATE_PREFIX) and StoredAggregate.decode(current).expires_at != expires_at
            ):
                self._change(key, None)
            self._index(index_key, None)
            expired += 1
        return expired

    def _change(self, key: bytes, value: bytes | None, expires_at: int | None = None) -> None:
        """A store write that the changelog carries. What expires gets its expiry index
        entry here, and says when in a header, from which a restore derives the same entry
        (no index record in the changelog)."""
        self.overlay.put(key, value)
        headers: Headers | None = None
        if expires_at is not None:
            self._index(expiry_key(expires_at, key), b"")
            headers = [expires_at_header(expires_at)]
        self._emit(self.topics.changelog, key, value, partition=self.partition, headers=headers)

    def _index(self, key: bytes, value: bytes | None) -> None:
        """A write to the store's local expiry index (rebuilt on restore, not in the changelog)."""
        self.overlay.put(key, value)

    def _emit(
        self,
        topic: str,
        key: bytes | None,
        value: bytes | None,
        partition: int | None = None,
        headers: Headers | None = None,
    ) -> None:
        # Every handled command and every expiry emits something: the batch starts here.
        if self._open.started is None:
            self._open.started = time.monotonic()
        self._open.outputs.append(Output(topic, key, value, partition, headers))

    def _dead_letter(self, record: ConsumerRecord[bytes, bytes], reason: str) -> None:
        log.warning("%s to the DLQ: %s", position(record.topic, record.partition, record.offset), reason)
        DLQ_RECORDS.labels(record.topic).inc()
        headers = [
            ("esk-dlq-reason", reason.encode()[:1000]),
            ("esk-dlq-topic", record.topic.encode()),
            ("esk-dlq-partition", str(record.partition).encode()),
            ("esk-dlq-offset", str(record.offset).encode()),
        ]
        self._emit(self.topics.dlq, record.key, record.value, partition=self.partition, headers=headers)

    # -- committing: driven by the TaskManager --------------------------------------

    def seal(self) -> Batch:
        """The open batch, ready to commit: with its store writes and the task's position
        (a changelog record, so a restore knows where the commands resume). A new batch opens."""
        batch, self._open = self._open, Batch(self.next_offset)
        batch.writes = self.overlay.seal()
        batch.end_offset = self.next_offset
        key, resume_at = position_key(self.partition), str(batch.end_offset).encode()
        batch.writes[key] = resume_at
        batch.outputs.append(Output(self.topics.changelog, key, resume_at, self.partition))
        return batch

    def committed(self, batch: Batch, written: dict[TopicPartition, int]) -> None:
        """`batch`'s transaction has committed (`written`: the last offset per partition):
        write the store, in one batch with the changelog offset it now reflects."""
        last = written.get(TopicPartition(self.topics.changelog, self.partition))
        self.store.write(batch.writes, {self.partition: last + 1} if last is not None else {})
        self.overlay.release()
        self.committed_offset = batch.end_offset

    def close(self) -> None:
        """Close the store. The batches not committed are dropped: the next owner handles
        their commands again from the committed position."""
        self.store.close()
