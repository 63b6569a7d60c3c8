"""The short variant of the broker-failure harness (`make cluster-test` runs it for
minutes): the package's three-node Kafka cluster, a processor, an API and the
example's subscribers as real processes, careful clients over HTTP, and brokers SIGKILLed
and restarted under load."""

from __future__ import annotations

from pathlib import Path

import pytest
from rich.console import Console

from bench import cluster_kill
from esk.broker.cluster import KafkaCluster

pytestmark = pytest.mark.kafka


@pytest.mark.timeout(600)
async def test_broker_kills_under_load_lose_duplicate_and_stop_nothing(kafka: KafkaCluster, tmp_path: Path) -> None:
    console = Console()
    verdict = await cluster_kill.run(
        kafka,
        tmp_path / "esk",
        cluster_kill.KillSchedule(duration_s=30, every_s=6, down_s=3, kills=2),
        cluster_kill.Workload(rate=40, clients=16, accounts=60, partitions=3, order_rate=3, seed=5),
        console,
    )
    console.print(verdict.table("broker kills"))
    for note in verdict.notes:
        console.print(note, highlight=False)
    assert verdict.broker_kills == 2
    assert verdict.topics.acknowledged > 100
    # every acknowledged command exactly one outcome, versions 1..n, served state = fold,
    # no command given up, /readyz always answered truthfully, processor, API and
    # subscribers alive, the subscriptions' effects exactly once
    assert verdict.ok, vars(verdict)
