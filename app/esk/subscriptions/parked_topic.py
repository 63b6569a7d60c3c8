"""The Kafka kinds' parked events: a compacted topic per subscription,
`<app>.subscription.<name>.parked`, one record per parked event (key
`parked/<topic>/<partition>/<offset>`, the latest value wins), written on the partition
number of the event's own partition, so that a member reads only the partitions it was
given. The same topic holds the replay marks a reset leaves (`replay/<topic>/<partition>`:
events below that offset are handled again, `ctx.replaying`).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.structs import ConsumerRecord

from ..kafka.client_options import client_options
from ..kafka.stopping import stop_consumer
from ..kafka.topics import TopicSpec
from ..settings import Settings
from .parking import ParkedEvent, ParkStatus


def parked_topic(app: str, subscription: str) -> str:
    return f"{app}.subscription.{subscription}.parked"


def parked_topic_spec(settings: Settings, subscription: str) -> TopicSpec:
    t = settings.topics
    return TopicSpec(
        parked_topic(settings.app, subscription),
        t.partitions,
        t.replication_factor,
        {"cleanup.policy": "compact", "min.insync.replicas": str(t.min_insync_replicas)},
    )


def parked_key(event: ParkedEvent) -> bytes:
    return f"parked/{event.position}".encode()


def replay_key(topic: str, partition: int) -> bytes:
    return f"replay/{topic}/{partition}".encode()


@dataclass
class ParkedPartitionState:
    """What one partition of the parked topic says, as of the last read."""

    parked: dict[str, ParkedEvent] = field(default_factory=dict)  # position -> latest record
    replay_until: dict[tuple[str, int], int] = field(default_factory=dict)  # (topic, partition) -> offset

    def still_parked(self, topic: str, partition: int) -> list[ParkedEvent]:
        """The events of input partition `topic`/`partition` parked now (neither retried nor
        skipped), in offset order."""
        found = [e for e in self.parked.values() if (e.topic, e.partition) == (topic, partition) and e.status is ParkStatus.PARKED]
        return sorted(found, key=lambda e: e.offset)


class ParkedTopic:
    """Follows a subscription's parked topic for the partitions a member was given: read up to
    the end when asked (`refresh`), read_committed, so it holds exactly what committed."""

    def __init__(self, settings: Settings, subscription: str) -> None:
        self.settings = settings
        self.topic = parked_topic(settings.app, subscription)
        self.partition_count = settings.topics.partitions
        self._states: dict[int, ParkedPartitionState] = {}
        self._positions: dict[int, int] = {}
        self._lock = asyncio.Lock()
        self._consumer: AIOKafkaConsumer | None = None

    def partition_of(self, source_partition: int) -> int:
        return source_partition % self.partition_count

    async def refresh(self, partition: int) -> ParkedPartitionState:
        """Read partition `partition` from where the last read ended up to its end now."""
        async with self._lock:
            if self._consumer is None:
                self._consumer = AIOKafkaConsumer(
                    **client_options(self.settings),
                    client_id=f"{self.topic}-reader",
                    isolation_level="read_committed",
                    enable_auto_commit=False,
                    group_id=None,
                    # It reads to a known end and stops: a fetch that waits for more only delays it.
                    fetch_max_wait_ms=20,
                )
                await self._consumer.start()
            consumer = self._consumer
            tp = TopicPartition(self.topic, partition)
            state = self._states.setdefault(partition, ParkedPartitionState())
            end = (await consumer.end_offsets([tp]))[tp]
            start = self._positions.get(partition)
            if start is None:
                start = (await consumer.beginning_offsets([tp]))[tp]
            if start < end:
                consumer.assign([tp])
                consumer.seek(tp, start)
                while await consumer.position(tp) < end:
                    for records in (await consumer.getmany(tp, timeout_ms=1000)).values():
                        for record in records:
                            apply_parked_record(state, record)
                start = await consumer.position(tp)
            self._positions[partition] = start
            return state

    async def close(self) -> None:
        if self._consumer is not None:
            await stop_consumer(self._consumer)
            self._consumer = None


def apply_parked_record(state: ParkedPartitionState, record: ConsumerRecord[bytes, bytes]) -> None:
    key = (record.key or b"").decode()
    kind, _, rest = key.partition("/")
    if kind == "parked":
        if record.value is None:
            state.parked.pop(rest, None)
        else:
            state.parked[rest] = ParkedEvent.decode(record.value)
    elif kind == "replay" and record.value is not None:
        topic, _, partition = rest.rpartition("/")
        state.replay_until[(topic, int(partition))] = int(record.value)
