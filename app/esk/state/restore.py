"""Brings a store up to date with its changelog partitions, from the offsets it records.

A store that is intact replays only what it has not seen (usually nothing); a new or
wiped one replays the whole compacted changelog. Reading is read_committed and ends at
the end offset taken when the restore starts: the partition's writer has been fenced
before we get here, so nothing newer is coming for it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.structs import ConsumerRecord

from ..protocol import EXPIRES_AT_HEADER, expiry_key
from .store import StateStore

log = logging.getLogger(__name__)

WRITE_BATCH_RECORDS = 10_000


@dataclass
class RestoreProgress:
    """How far a restore (or a rebuild: `what`) of one partition's store has come."""

    partition: int
    start_offset: int = 0
    end_offset: int = 0
    restored: int = 0
    started: float = field(default_factory=time.monotonic)
    finished: float | None = None
    what: str = "restoring"

    @property
    def total(self) -> int:
        return max(self.end_offset - self.start_offset, 0)

    @property
    def remaining(self) -> int:
        """What is left to read: none once finished (the offsets between start and end count
        transaction markers too, which no record stands for)."""
        return 0 if self.finished is not None else max(self.total - self.restored, 0)

    @property
    def elapsed(self) -> float:
        """Seconds from its start to its end, or to now while it runs."""
        return (self.finished or time.monotonic()) - self.started

    @property
    def rate(self) -> float:
        elapsed = self.elapsed
        return self.restored / elapsed if elapsed > 0 else 0.0


async def restore(
    consumer: AIOKafkaConsumer,
    store: StateStore,
    topic: str,
    partitions: Iterable[int],
    on_progress: Callable[[RestoreProgress], None] = lambda _p: None,
    expiry_index: bool = False,
) -> dict[int, RestoreProgress]:
    """Apply every committed changelog record the store has not seen yet; with
    `expiry_index`, also rebuild the store's local expiry index from the records' headers.

    `consumer` must be read_committed, without a group, and is used for these partitions only.
    """
    tps = [TopicPartition(topic, p) for p in partitions]
    stored = store.changelog_offsets()
    consumer.assign(tps)
    beginnings = await consumer.beginning_offsets(tps)
    ends = await consumer.end_offsets(tps)
    progress: dict[int, RestoreProgress] = {}
    for tp in tps:
        start = stored.get(tp.partition, beginnings[tp])
        if start > ends[tp]:
            # The store claims offsets the topic never had (topic recreated): it cannot be trusted.
            raise StaleStoreError(f"store is at offset {start} of {tp}, beyond its end {ends[tp]}")
        start = max(start, beginnings[tp])
        consumer.seek(tp, start)
        progress[tp.partition] = RestoreProgress(tp.partition, start, ends[tp])
    pending = {tp for tp in tps if progress[tp.partition].total > 0}
    while pending:
        batches = await consumer.getmany(*pending, timeout_ms=500, max_records=WRITE_BATCH_RECORDS)
        updates = changelog_updates(batches, expiry_index)
        offsets: dict[int, int] = {}
        for tp, records in batches.items():
            progress[tp.partition].restored += len(records)
        for tp in list(pending):
            # The position moves past transaction markers too, so it reaches the end offset
            # even when the last entry of the log is a commit or abort marker.
            position = await consumer.position(tp)
            offsets[tp.partition] = position
            if position >= ends[tp]:
                pending.discard(tp)
        store.write(updates, offsets)
        for tp in tps:
            on_progress(progress[tp.partition])
    for p in progress.values():
        p.finished = time.monotonic()
        if p.total:
            on_progress(p)  # none left: the markers past its last record are read too
        if p.restored:
            log.info(
                "restored %d record%s of %s[%d] in %.1f s (%.0f records/s)",
                p.restored, "" if p.restored == 1 else "s", topic, p.partition, p.elapsed, p.rate,
            )
    return progress


class StaleStoreError(RuntimeError):
    pass


def changelog_updates(
    batches: Mapping[TopicPartition, list[ConsumerRecord[bytes, bytes]]], expiry_index: bool = False
) -> dict[bytes, bytes | None]:
    """The store writes a batch of changelog records amounts to: the last value per key wins,
    a tombstone (None) deletes. An index entry left behind by a later change of the expiry
    is harmless: the sweep checks what it points at before deleting anything."""
    updates: dict[bytes, bytes | None] = {}
    for records in batches.values():
        for record in records:
            if record.key is None:
                continue
            updates[record.key] = record.value
            if expiry_index and record.headers:
                for name, value in record.headers:
                    if name == EXPIRES_AT_HEADER:
                        updates[expiry_key(int(value), record.key)] = b""
    return updates
