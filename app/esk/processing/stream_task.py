"""StreamTask: the single-threaded owner of one commands partition.

Commands are handled against an in-memory overlay on top of the RocksDB store; their
outputs are buffered in the open Batch. At commit, ONE Kafka transaction carries the
events, the outcomes, the changelog records and the task's input position (RecordCollector
sends them as record batches). Only after that transaction has committed is RocksDB
written, in one batch together with the changelog offset it now reflects.

The position is a changelog record (`p/<partition>`: the next commands offset), so a
restored store knows where its commands resume. The consumer group's offset, which costs
two more round trips in a transaction (AddOffsetsToTxn, TxnOffsetCommit), is added to a
transaction only every `group_offset_interval_ms` and before the task closes: it is there
for lag monitoring, and a task resumes from whichever of the two is further on.

A commit seals the open batch and a new one opens at once: commands keep being handled
while the sealed batch's transaction is in flight, reading through both overlays. One
commit at a time: the producer has one transaction, and batch N+1 commits only after N.

Crash ordering, which is the whole point:
- crash before the commit: the transaction is aborted (or fenced by the next owner);
  RocksDB never saw the overlay; the commands are read again from the committed position.
- crash after the commit, before the RocksDB write: the store is behind the changelog,
  and the next owner restores from the offset the store records. Never ahead, never torn.
- a failed commit fails the task: the batch handled on top of the failed one is
  discarded with it (it read the failed batch's writes); the next task starts again from
  the committed position.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import cast

from aiokafka import AIOKafkaProducer, TopicPartition
from aiokafka.structs import ConsumerRecord

from ..kafka.topics import TopicNames
from ..metrics import COMMANDS, COMMIT_SECONDS, DLQ_RECORDS, TRANSACTION_RECORDS
from .command_handler import handle_command, refusal
from .record_collector import Headers, Output, RecordCollector
from ..protocol import (
    AGGREGATE_PREFIX,
    EXPIRY_PREFIX,
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
    position_key,
)
from ..registry import Registry
from ..state.store import StateStore

log = logging.getLogger(__name__)


_ABSENT = object()  # not in an overlay (None there means deleted)


@dataclass(slots=True)
class Batch:
    """What the commands from `start_offset` on have handled so far, not yet in Kafka."""

    start_offset: int
    writes: dict[bytes, bytes | None] = field(default_factory=dict)  # store writes, None deletes
    outputs: list[Output] = field(default_factory=list)
    started: float | None = None  # monotonic time of its first output


class StreamTask:
    def __init__(
        self,
        partition: int,
        topics: TopicNames,
        registry: Registry,
        store: StateStore,
        producer: AIOKafkaProducer,
        group_id: str,
        next_offset: int,
        group_offset: int | None,
        dedup_window_ms: int,
        group_offset_interval_s: float,
    ) -> None:
        self.partition = partition
        self.topics = topics
        self.registry = registry
        self.store = store
        self.producer = producer
        self.collector = RecordCollector(producer)
        self.group_id = group_id
        self.input = TopicPartition(topics.commands, partition)
        self.next_offset = next_offset  # the next commands offset this task has to handle
        self.committed_offset = next_offset  # the position the last committed transaction recorded
        self.group_offset = group_offset  # the consumer group's committed offset (None: none yet)
        self.dedup_window_ms = dedup_window_ms
        self.group_offset_interval_s = group_offset_interval_s
        self._group_offset_due = time.monotonic() + group_offset_interval_s
        self._open = Batch(next_offset)
        self._sealed: Batch | None = None  # the batch whose transaction is in flight
        self._fetched: dict[bytes, bytes | None] = {}  # store values read ahead by process()
        self._counted: Counter[tuple[str, str]] = Counter()  # commands by (type, outcome), for COMMANDS
        self.last_commit_started = -math.inf  # monotonic time its last transaction began
        self._commit_lock = asyncio.Lock()
        self._failed: BaseException | None = None
        self._closed = False

    # -- handling ----------------------------------------------------------------

    @property
    def has_pending(self) -> bool:
        """The open batch has something to commit."""
        return self.next_offset > self._open.start_offset or bool(self._open.outputs)

    def group_offset_due(self) -> bool:
        """The consumer group's offset is behind and due to be committed: even with no
        command pending, so that an idle partition's lag goes down to zero."""
        return self.group_offset != self.committed_offset and time.monotonic() >= self._group_offset_due

    @property
    def pending_commands(self) -> int:
        return self.next_offset - self._open.start_offset

    def batch_age(self) -> float:
        started = self._open.started
        return 0.0 if started is None else time.monotonic() - started

    def process(self, records: Sequence[ConsumerRecord[bytes, bytes]]) -> None:
        """Handle `records` in order. The store values they read are fetched first, in one
        multi-get rather than one get per key (bench/handling.py). Nothing here awaits, and
        that keeps the fetched values true: the store is written only by a commit, and a
        commit runs only when the handling gives the loop a turn."""
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
        self._fetched = self.store.get_many([key for key in wanted if self._overlay(key) is _ABSENT])
        try:
            for record, decoded, command_store_key, aggregate_store_key in handled:
                self.next_offset = record.offset + 1
                if isinstance(decoded, DecodeError):
                    self._dead_letter(record, str(decoded))
                else:
                    self._handle(record, decoded, command_store_key, aggregate_store_key)
        finally:
            self._fetched = {}
            # one increment per kind and chunk: `labels()` and `inc()` each take a lock
            for (aggregate_type, outcome), count in self._counted.items():
                COMMANDS.labels(aggregate_type, outcome).inc(count)
            self._counted.clear()

    def _handle(
        self,
        record: ConsumerRecord[bytes, bytes],
        envelope: CommandEnvelope,
        command_store_key: bytes,
        aggregate_store_key: bytes,
    ) -> None:
        record_key = envelope.key  # the aggregate's: its events and outcomes carry it too
        if record.key != record_key:
            # Ordering (G1) rests on every command of an aggregate sharing a partition.
            self._dead_letter(record, f"record key {record.key!r} does not match aggregate {record_key!r}")
            return
        previous = self._get(command_store_key)
        if previous is not None:
            # A retry: answer with the original outcome, change nothing (G3).
            self._emit(self.topics.results, record_key, previous)
            self._counted[envelope.aggregate_type, "duplicate"] += 1
            return
        aggregate_type = self.registry.get(envelope.aggregate_type)
        if aggregate_type is None:
            detail = f"no aggregate type {envelope.aggregate_type!r}"
            outcome = refusal(envelope, Status.REJECTED, "unknown_aggregate_type", detail, 0, now_ms())
            self._record_outcome(outcome, command_store_key, record_key)
            return
        raw = self._get(aggregate_store_key)
        stored = StoredAggregate.decode(raw) if raw is not None else None
        handled = handle_command(aggregate_type, envelope, stored, now_ms())
        events_topic = self.topics.events(envelope.aggregate_type)
        for event in handled.events:
            self._emit(events_topic, record_key, event.encode(), headers=event.headers())
        if handled.aggregate is not None:
            self._change(aggregate_store_key, handled.aggregate.encode(), handled.aggregate.expires_at)
            expires_before = stored.expires_at if stored is not None else None
            if expires_before is not None and expires_before != handled.aggregate.expires_at:
                self._index(expiry_key(expires_before, aggregate_store_key), None)
        self._record_outcome(handled.outcome, command_store_key, record_key)

    def _record_outcome(self, outcome: Outcome, command_store_key: bytes, record_key: bytes) -> None:
        """`command_store_key`: where the outcome answers retries; `record_key`: the
        aggregate's record key, which the outcome is published under."""
        value = outcome.encode()
        self._emit(self.topics.results, record_key, value)
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
            if self._overlay(index_key) is not _ABSENT:
                continue  # deleted in a batch not yet in the store
            expires_at, key = parse_expiry_key(index_key)
            current = self._get(key)
            if current is not None and not (
                key.startswith(AGGREGATE_PREFIX) and StoredAggregate.decode(current).expires_at != expires_at
            ):
                self._change(key, None)
            self._index(index_key, None)
            expired += 1
        return expired

    def _get(self, key: bytes) -> bytes | None:
        value = self._overlay(key)
        if value is _ABSENT:
            value = self._fetched.get(key, _ABSENT)
        return self.store.get(key) if value is _ABSENT else cast("bytes | None", value)

    def _overlay(self, key: bytes) -> object:
        """The key's latest write not yet in the store, or _ABSENT."""
        value = self._open.writes.get(key, _ABSENT)
        if value is _ABSENT and self._sealed is not None:
            value = self._sealed.writes.get(key, _ABSENT)
        return value

    def _change(self, key: bytes, value: bytes | None, expires_at: int | None = None) -> None:
        """A store write that the changelog carries. What expires gets its expiry index
        entry here, and says when in a header, from which a restore derives the same entry
        (no index record in the changelog)."""
        self._open.writes[key] = value
        headers: Headers | None = None
        if expires_at is not None:
            self._index(expiry_key(expires_at, key), b"")
            headers = [expires_at_header(expires_at)]
        self._emit(self.topics.changelog, key, value, partition=self.partition, headers=headers)

    def _index(self, key: bytes, value: bytes | None) -> None:
        """A write to the store's local expiry index (rebuilt on restore, not in the changelog)."""
        self._open.writes[key] = value

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
        log.warning("%s[%d]@%d to the DLQ: %s", record.topic, record.partition, record.offset, reason)
        DLQ_RECORDS.labels(record.topic).inc()
        headers = [
            ("esk-dlq-reason", reason.encode()[:1000]),
            ("esk-dlq-topic", record.topic.encode()),
            ("esk-dlq-partition", str(record.partition).encode()),
            ("esk-dlq-offset", str(record.offset).encode()),
        ]
        self._emit(self.topics.dlq, record.key, record.value, partition=self.partition, headers=headers)

    # -- committing ----------------------------------------------------------------

    async def commit(self, final: bool = False) -> None:
        """Seal the open batch and commit it in one transaction, then write RocksDB; a
        commit in flight is waited for first. `final` (before the task closes): bring the
        consumer group's offset up to date too. Raises on any failure, and the task is
        then failed for good: the caller discards it and builds a fresh one."""
        async with self._commit_lock:
            if self._failed is not None or self._closed:
                raise RuntimeError(f"partition {self.partition}: the task is {'closed' if self._closed else 'failed'}")
            with_group_offset = self.group_offset_due() or (final and self.group_offset != self.next_offset)
            if not self.has_pending and not with_group_offset:
                return
            batch, self._open = self._open, Batch(self.next_offset)
            self._sealed = batch
            self.last_commit_started = time.monotonic()
            try:
                await self._commit(batch, end_offset=self._open.start_offset, with_group_offset=with_group_offset)
            except BaseException as error:
                self._failed = error
                raise
            finally:
                self._sealed = None

    async def _commit(self, batch: Batch, end_offset: int, with_group_offset: bool) -> None:
        started = time.monotonic()
        key, position = position_key(self.partition), str(end_offset).encode()
        batch.writes[key] = position
        batch.outputs.append(Output(self.topics.changelog, key, position, self.partition))
        await self.producer.begin_transaction()
        last_offsets = await self.collector.send(batch.outputs)
        if with_group_offset:
            await self.producer.send_offsets_to_transaction({self.input: end_offset}, self.group_id)
        await self.producer.commit_transaction()
        offsets = {}
        changelog_last = last_offsets.get(TopicPartition(self.topics.changelog, self.partition))
        if changelog_last is not None:
            offsets[self.partition] = changelog_last + 1
        self.store.write(batch.writes, offsets)
        TRANSACTION_RECORDS.observe(len(batch.outputs))
        COMMIT_SECONDS.observe(time.monotonic() - started)
        self.committed_offset = end_offset
        if with_group_offset:
            self.group_offset = end_offset
            self._group_offset_due = time.monotonic() + self.group_offset_interval_s

    async def close(self) -> None:
        """Close the producer and the store, once a commit in flight is over."""
        async with self._commit_lock:
            self._closed = True
            try:
                await self.producer.stop()
            finally:
                self.store.close()
