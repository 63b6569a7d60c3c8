"""One three-node Kafka cluster (esk.broker.KafkaCluster, free loopback ports) for the
tests of this package, stopped after the last of them."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from bench.cluster_kill import scratch_kafka_cluster
from esk.broker.cluster import KafkaCluster


@pytest.fixture(scope="package")
async def kafka() -> AsyncIterator[KafkaCluster]:
    async with scratch_kafka_cluster("esk-test-cluster") as cluster:
        yield cluster
