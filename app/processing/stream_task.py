"""StreamTask: the single-threaded owner of one commands partition.

Commands are handled against an in-memory overlay on top of the RocksDB store; their
outputs are buffered. At commit, ONE Kafka transaction carries the events, the outcomes,
the changelog records and the consumer offset (RecordCollector sends them as record
batches). Only after that transaction has committed is RocksDB written, in one batch
together with the changelog offset it now reflects.

Crash ordering, which is the whole point:
- crash before the commit: the transaction is aborted (or fenced by the next owner);
  RocksDB never saw the overlay; the commands are read again from the committed offset.
- crash after the commit, before the RocksDB write: the store is behind the changelog,
  and the next owner restores from the offset the store records. Never ahead, never torn.
"""

from __future__ import annotations

import logging
import time

from aiokafka import AIOKafkaProducer, TopicPartition
from aiokafka.structs import ConsumerRecord

from app.kafka.topics import TopicNames
from app.metrics import COMMANDS, COMMIT_SECONDS, DLQ_RECORDS, TRANSACTION_RECORDS
from app.processing.command_handler import handle_command, refusal
from app.processing.record_collector import Headers, Output, RecordCollector
from app.protocol import (
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
)
from app.registry import Registry
from app.state.store import StateStore

log = logging.getLogger(__name__)


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
        dedup_window_ms: int,
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
        self.committed_offset = next_offset
        self.dedup_window_ms = dedup_window_ms
        self._writes: dict[bytes, bytes | None] = {}
        self._outputs: list[Output] = []
        self._batch_started: float | None = None
        self._batch_commands = 0

    # -- handling ----------------------------------------------------------------

    @property
    def has_pending(self) -> bool:
        return self.next_offset > self.committed_offset or bool(self._outputs)

    @property
    def pending_commands(self) -> int:
        return self.next_offset - self.committed_offset

    def batch_age(self) -> float:
        return 0.0 if self._batch_started is None else time.monotonic() - self._batch_started

    def process(self, record: ConsumerRecord[bytes, bytes]) -> None:
        if record.offset < self.next_offset:
            return  # fetched before a rewind; handled already
        self.next_offset = record.offset + 1
        try:
            envelope = CommandEnvelope.decode(record.value)
        except DecodeError as error:
            self._dead_letter(record, str(error))
            return
        if record.key != envelope.key:
            # Ordering (G1) rests on every command of an aggregate sharing a partition.
            self._dead_letter(record, f"record key {record.key!r} does not match aggregate {envelope.key!r}")
            return
        previous = self._get(command_key(envelope.command_id))
        if previous is not None:
            # A retry: answer with the original outcome, change nothing (G3).
            self._emit(self.topics.results, envelope.command_id.encode(), previous)
            COMMANDS.labels(envelope.aggregate_type, "duplicate").inc()
            return
        aggregate_type = self.registry.get(envelope.aggregate_type)
        if aggregate_type is None:
            detail = f"no aggregate type {envelope.aggregate_type!r}"
            self._record_outcome(refusal(envelope, Status.REJECTED, "unknown_aggregate_type", detail, 0, now_ms()))
            return
        key = aggregate_key(envelope.aggregate_type, envelope.aggregate_id)
        raw = self._get(key)
        stored = StoredAggregate.decode(raw) if raw is not None else None
        handled = handle_command(aggregate_type, envelope, stored, now_ms())
        events_topic = self.topics.events(envelope.aggregate_type)
        for event in handled.events:
            self._emit(events_topic, envelope.aggregate_id.encode(), event.encode(), headers=event.headers())
        if handled.aggregate is not None:
            self._change(key, handled.aggregate.encode(), handled.aggregate.expires_at)
            expires_before = stored.expires_at if stored is not None else None
            if expires_before is not None and expires_before != handled.aggregate.expires_at:
                self._index(expiry_key(expires_before, key), None)
        self._record_outcome(handled.outcome)

    def _record_outcome(self, outcome: Outcome) -> None:
        value = outcome.encode()
        key = command_key(outcome.command_id)
        self._emit(self.topics.results, outcome.command_id.encode(), value)
        self._change(key, value, expires_at=outcome.processed_at + self.dedup_window_ms)
        COMMANDS.labels(outcome.aggregate_type, outcome.code or outcome.status.value).inc()

    def expire(self, now: int, limit: int) -> int:
        """Delete what expired before `now` (final aggregates past their retention,
        de-duplication entries past the window), at most `limit` of them. The deletes are
        tombstones in the changelog, committed with the next batch, so a restore never
        resurrects them and compaction drops them from the topic too."""
        expired = 0
        for index_key, _ in self.store.scan(EXPIRY_PREFIX, expiry_bound(now)):
            if expired >= limit:
                break
            if index_key in self._writes:
                continue  # deleted in this batch already
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
        if key in self._writes:
            return self._writes[key]
        return self.store.get(key)

    def _change(self, key: bytes, value: bytes | None, expires_at: int | None = None) -> None:
        """A store write that the changelog carries. What expires gets its expiry index
        entry here, and says when in a header, from which a restore derives the same entry
        (no index record in the changelog)."""
        self._writes[key] = value
        headers: Headers = ()
        if expires_at is not None:
            self._index(expiry_key(expires_at, key), b"")
            headers = (expires_at_header(expires_at),)
        self._emit(self.topics.changelog, key, value, partition=self.partition, headers=headers)

    def _index(self, key: bytes, value: bytes | None) -> None:
        """A write to the store's local expiry index (rebuilt on restore, not in the changelog)."""
        self._writes[key] = value

    def _emit(
        self,
        topic: str,
        key: bytes | None,
        value: bytes | None,
        partition: int | None = None,
        headers: Headers = (),
    ) -> None:
        # Every handled command and every expiry emits something: the batch starts here.
        if self._batch_started is None:
            self._batch_started = time.monotonic()
        self._outputs.append(Output(topic, key, value, partition, headers))

    def _dead_letter(self, record: ConsumerRecord[bytes, bytes], reason: str) -> None:
        log.warning("%s[%d]@%d to the DLQ: %s", record.topic, record.partition, record.offset, reason)
        DLQ_RECORDS.labels(record.topic).inc()
        headers = (
            ("esk-dlq-reason", reason.encode()[:1000]),
            ("esk-dlq-topic", record.topic.encode()),
            ("esk-dlq-partition", str(record.partition).encode()),
            ("esk-dlq-offset", str(record.offset).encode()),
        )
        self._emit(self.topics.dlq, record.key, record.value, partition=self.partition, headers=headers)

    # -- committing ----------------------------------------------------------------

    async def commit(self) -> None:
        """Commit the open batch in one transaction, then write RocksDB. Raises on any
        failure; the caller then discards this task and builds a fresh one."""
        if not self.has_pending:
            return
        started = time.monotonic()
        await self.producer.begin_transaction()
        last_offsets = await self.collector.send(self._outputs)
        await self.producer.send_offsets_to_transaction({self.input: self.next_offset}, self.group_id)
        await self.producer.commit_transaction()
        offsets = {}
        changelog_last = last_offsets.get(TopicPartition(self.topics.changelog, self.partition))
        if changelog_last is not None:
            offsets[self.partition] = changelog_last + 1
        self.store.write(self._writes, offsets)
        TRANSACTION_RECORDS.observe(len(self._outputs))
        COMMIT_SECONDS.observe(time.monotonic() - started)
        self.committed_offset = self.next_offset
        self._writes = {}
        self._outputs = []
        self._batch_started = None

    async def close(self) -> None:
        try:
            await self.producer.stop()
        finally:
            self.store.close()
