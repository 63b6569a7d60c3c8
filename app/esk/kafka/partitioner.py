"""Where the Java client's default partitioner puts a keyed record: murmur2 of the key,
made positive, modulo the partition count. Consumers in any language rely on that
placement (all records of one key on one partition, wherever they were written from).

aiokafka computes murmur2 in Python; the processor places three records per command, so
it uses murmurhash2's C implementation instead, some twenty times faster
(docs/benchmarks.md, probes).
"""

from __future__ import annotations

from murmurhash2 import murmurhash2

_SEED = 0x9747B28C  # the seed of Kafka's Utils.murmur2


def partition_for(key: bytes, partitions: int) -> int:
    return int((murmurhash2(key, _SEED) & 0x7FFFFFFF) % partitions)
