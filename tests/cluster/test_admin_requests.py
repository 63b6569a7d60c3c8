"""Admin requests (topics, their partitions) while a broker of the cluster is dead: for
some seconds its peers' metadata still name it, and aiokafka's admin client sends a
request to whichever broker that metadata names. `esk subscriber` died at its start in
the broker-failure harness this way (ensure_topics of its parked topic), and the API's
replica would stop at `topic_partitions` before catching up."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from aiokafka.errors import NodeNotReadyError, TopicAuthorizationFailedError

from esk.broker.cluster import KafkaCluster
from esk.kafka.admin import retry_while_brokers_fail
from esk.kafka.metadata import topic_partitions
from esk.kafka.topics import TopicNames, ensure_topics, topic_specs
from esk.settings import Settings


async def test_a_request_is_asked_again_while_its_broker_is_down_and_no_longer() -> None:
    attempts = 0

    async def answered_on_the_third_attempt() -> str:
        nonlocal attempts
        attempts += 1
        if attempts < 3:
            raise NodeNotReadyError("node 2 is down")
        return "answer"

    assert await retry_while_brokers_fail(answered_on_the_third_attempt) == "answer"
    assert attempts == 3

    async def refused() -> None:
        raise TopicAuthorizationFailedError()

    with pytest.raises(TopicAuthorizationFailedError):  # not something another broker would answer otherwise
        await retry_while_brokers_fail(refused)

    async def never_answered() -> None:
        raise NodeNotReadyError("the cluster is down")

    with pytest.raises(NodeNotReadyError):
        await retry_while_brokers_fail(never_answered, timeout_s=0.5)


@pytest.mark.kafka
async def test_admin_requests_ride_out_a_broker_that_just_died(kafka: KafkaCluster) -> None:
    settings = Settings(
        app=f"admin{uuid.uuid4().hex[:6]}",
        kafka={"bootstrap_servers": kafka.bootstrap},
        topics={"partitions": 3, "replication_factor": 3, "min_insync_replicas": 2},
        _env_file=None,
    )
    specs = topic_specs(settings, ["accounts"])
    assert not (await ensure_topics(settings, specs)).problems
    victim = 2
    await asyncio.to_thread(kafka.kill, victim)
    try:
        # each round is several requests, each to a broker drawn from metadata that still
        # names the dead one: without retries, a few rounds are enough for one to fail
        for _ in range(10):
            assert await topic_partitions(settings, TopicNames(settings.app).changelog) == [0, 1, 2]
            report = await ensure_topics(settings, specs)
            assert not report.problems and sorted(report.ok) == sorted(s.name for s in specs)
    finally:
        await asyncio.to_thread(kafka.start, victim)
