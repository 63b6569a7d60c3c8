"""partition_for places keys as the Java client's default partitioner does."""

from __future__ import annotations

import random

import pytest
from aiokafka.partitioner import DefaultPartitioner

from esk.kafka.partitioner import partition_for

# Utils.murmur2 of these keys, from Kafka's own UtilsTest
JAVA_MURMUR2 = {
    b"21": -973932308,
    b"foobar": -790332482,
    b"a-little-bit-long-string": -985981536,
    b"a-little-bit-longer-string": -1486304829,
    b"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8": -58897971,
    b"abc": 479470107,
}


@pytest.mark.parametrize("partitions", [1, 3, 6, 7, 64, 1000])
def test_keys_land_where_the_java_partitioner_puts_them(partitions: int) -> None:
    for key, murmur2 in JAVA_MURMUR2.items():
        assert partition_for(key, partitions) == (murmur2 & 0x7FFFFFFF) % partitions


def test_keys_land_where_aiokafka_send_puts_them() -> None:
    rng = random.Random(7)
    partitioner = DefaultPartitioner()
    for _ in range(5000):
        key = rng.randbytes(rng.randint(0, 80))
        partitions = list(range(rng.randint(1, 50)))
        assert partition_for(key, len(partitions)) == partitioner(key, partitions, partitions)
