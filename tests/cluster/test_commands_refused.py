"""The API's gateway over the package's three-node cluster with two of its nodes killed:
the one left answers, and stores nothing (no quorum of controllers, its partitions below
`min.insync.replicas`). The outage holds until a command is stored: each time the probe
finds a broker answering, one command tries, the others refused at once, rather than every
client waiting out the timeout and the API saying, every few seconds, that commands are
taken again (a user trial's find: the gauge up 1 s in 11, its alert never firing)."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import pytest
from prometheus_client import REGISTRY

from esk.api.gateway import CommandGateway, KafkaAway
from esk.broker.cluster import KafkaCluster
from esk.kafka.topics import ensure_topics, topic_specs
from esk.registry import load_registry
from esk.settings import Settings
from tests.api.test_gateway import deposit, until_stored

pytestmark = pytest.mark.kafka


@pytest.mark.timeout(300)
async def test_a_cluster_that_answers_and_stores_nothing_keeps_commands_refused_one_trying_at_a_time(
    kafka: KafkaCluster, caplog: pytest.LogCaptureFixture
) -> None:
    settings = Settings(
        app=f"refused{uuid.uuid4().hex[:6]}",
        kafka={"bootstrap_servers": kafka.bootstrap},
        topics={"partitions": 3, "replication_factor": 3, "min_insync_replicas": 2},
        api={"submit_timeout_s": 2.0},
        _env_file=None,
    )
    assert not (await ensure_topics(settings, topic_specs(settings, load_registry(settings.domain)))).problems
    gateway = CommandGateway(settings)
    await gateway.start()
    caplog.set_level(logging.INFO, logger="esk.api.gateway")
    killed = [2, 3]
    try:
        await gateway.submit(deposit("before"))
        for node in killed:
            await asyncio.to_thread(kafka.kill, node)
        with pytest.raises(TimeoutError):
            await gateway.submit(deposit("not-stored"))
        tried = refused = 0
        started = time.monotonic()
        while time.monotonic() - started < 10:  # the probe finds node 1 answering, a few times
            outcomes = await asyncio.gather(*(gateway.submit(deposit(f"refused-{n}")) for n in range(5)), return_exceptions=True)
            assert all(isinstance(o, TimeoutError | KafkaAway) for o in outcomes), outcomes
            tried += sum(isinstance(o, TimeoutError) for o in outcomes)
            refused += sum(isinstance(o, KafkaAway) for o in outcomes)
            assert REGISTRY.get_sample_value("esk_api_kafka_away") == 1
            await asyncio.sleep(0.2)
        assert 1 <= tried <= 5 and refused > 5 * tried, (tried, refused)  # one at a time, a try a probe
        await asyncio.to_thread(kafka.start)  # both at once: neither answers without the other's vote
        # as a client retries: refused at once, tried (and timed out) once the probe finds a broker
        await until_stored(gateway, deposit("after"), timeout_s=120, retried=(KafkaAway, TimeoutError))
        assert gateway.away_since is None and REGISTRY.get_sample_value("esk_api_kafka_away") == 0
    finally:
        await gateway.stop()
        await asyncio.to_thread(kafka.start)
        await asyncio.to_thread(kafka.wait_fully_replicated, 120)  # for the package's next test
    told = [r.getMessage() for r in caplog.records if r.name == "esk.api.gateway" and r.levelno >= logging.INFO]
    assert len(told) == 2, told
    assert told[0].startswith("a command was not stored (") and told[1].startswith("a command was stored: commands are taken again"), told
