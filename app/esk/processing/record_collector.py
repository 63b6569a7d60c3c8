"""RecordCollector: the outputs of one task's batch, sent as record batches.

aiokafka's per-record `send` spends tens of microseconds of Python on every record, and
it was most of the processor's time. Appending to one record batch per topic partition
and handing each full batch to the producer is much cheaper (docs/benchmarks.md, probes).
Keyed records land on the partition the Java client's default partitioner picks (murmur2
of the key), as `send` would have put them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from aiokafka import AIOKafkaProducer, TopicPartition

from ..kafka.partitioner import partition_for

# A batch is one request entry: large ones keep the number of round trips per commit low,
# while staying under the broker's default message.max.bytes (1 MiB).
MAX_BATCH_BYTES = 512 * 1024

# A list, not any sequence: aiokafka's C record builder takes nothing else, and a copy per
# record is measurable.
Headers = list[tuple[str, bytes]]


@dataclass(slots=True)  # not frozen: several per command, and a frozen __init__ costs several times more
class Output:
    topic: str
    key: bytes | None
    value: bytes | None
    partition: int | None = None  # None: by key
    headers: Headers | None = None


class RecordCollector:
    def __init__(self, producer: AIOKafkaProducer) -> None:
        self.producer = producer
        self._partition_counts: dict[str, int] = {}

    async def send(self, outputs: Sequence[Output]) -> dict[TopicPartition, int]:
        """Send `outputs` inside the producer's open transaction and wait until the broker
        has them all; return the offset of the last record written to each partition."""
        counts = self._partition_counts
        for topic in {out.topic for out in outputs if out.partition is None} - set(counts):
            counts[topic] = len(await self.producer.partitions_for(topic))
        # Keyed by (topic, partition) tuples: this loop runs for every record of a batch,
        # and a TopicPartition per record cost more than the append itself.
        builders: dict[tuple[str, int], Any] = {}
        appended: dict[tuple[str, int], int] = {}
        sent: list[tuple[tuple[str, int], int, asyncio.Future[Any]]] = []
        for out in outputs:
            partition = out.partition
            if partition is None:
                if out.key is None:
                    raise ValueError(f"a record for {out.topic} needs a key or a partition")
                partition = partition_for(out.key, counts[out.topic])
            tp = (out.topic, partition)
            builder = builders.get(tp)
            if builder is None or not _append(builder, out):
                if builder is not None:  # full: off it goes
                    sent.append((tp, appended[tp], await self.producer.send_batch(builder, tp[0], partition=tp[1])))
                builder = builders[tp] = self.producer.create_batch()
                appended[tp] = 0
                if not _append(builder, out):
                    raise ValueError(f"a record for {tp[0]}[{tp[1]}] is larger than a batch ({MAX_BATCH_BYTES} bytes)")
            appended[tp] += 1
        for tp, builder in builders.items():
            sent.append((tp, appended[tp], await self.producer.send_batch(builder, tp[0], partition=tp[1])))
        await asyncio.gather(*(future for _, _, future in sent))
        last: dict[TopicPartition, int] = {}
        for (topic, partition), count, future in sent:
            tp = TopicPartition(topic, partition)
            last[tp] = max(last.get(tp, -1), future.result().offset + count - 1)
        return last


_NO_HEADERS: Headers = []  # shared: the builder only reads it


def _append(builder: Any, out: Output) -> bool:
    headers = out.headers if out.headers is not None else _NO_HEADERS
    return builder.append(timestamp=None, key=out.key, value=out.value, headers=headers) is not None
