"""A processor that gives its partitions up while its broker is away (a stop, a rebalance)
waits for the commits in flight at most `close_timeout_ms`: a commit waits on its broker for
as long as the broker is away, and a SIGTERM during a 90 s outage was answered only when the
broker came back. Closed without them, nothing is lost or doubled: the next owner handles
their commands again. Against a broker of the test's own, killed and started again."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import pytest

from bench import crash
from bench.cluster import Cluster, api_ready, wait_until
from esk.broker import EmbeddedBroker
from esk.broker.ports import free_port_pair
from esk.kafka.topics import ensure_topics, topic_specs
from esk.registry import load_registry
from esk.settings import BrokerSettings
from tests.conftest import own_settings

pytestmark = pytest.mark.kafka

CLOSE_TIMEOUT_S = 3


async def test_a_processor_stopped_while_its_broker_is_away_stops_within_its_close_timeout(tmp_path: Path) -> None:
    broker = EmbeddedBroker(BrokerSettings(port=free_port_pair(), data_dir=tmp_path / "broker"))
    await asyncio.to_thread(broker.start)
    cluster = None
    try:
        settings = own_settings(broker, tmp_path)
        await ensure_topics(settings, topic_specs(settings, load_registry(settings.domain)))
        cluster = Cluster(settings, tmp_path / "cluster")
        bounded = {"ESK_PROCESSOR__CLOSE_TIMEOUT_MS": str(CLOSE_TIMEOUT_S * 1000)}
        api, stopped = cluster.api("api"), cluster.processor("stopped", **bounded)
        api.start()
        stopped.start()
        url = f"http://127.0.0.1:{api.port}"
        await asyncio.to_thread(wait_until, lambda: api_ready(url), 60, "API ready")
        partitions = settings.topics.partitions
        await asyncio.to_thread(wait_until, lambda: stopped.metric("esk_active_tasks") == partitions, 60, "all owned")
        load = crash.Load(url, [f"acc-{n}" for n in range(30)], rate=60, seed=7)
        driving = asyncio.create_task(load.run())
        await asyncio.sleep(2)
        await asyncio.to_thread(broker.node.kill)
        await asyncio.sleep(1)  # the commits in flight wait on it now
        asked = time.monotonic()
        stopped.signal(signal.SIGTERM)
        await asyncio.to_thread(wait_until, lambda: not stopped.alive, 30, "the processor to stop")
        took = time.monotonic() - asked
        log = stopped.log_text()
        assert "closed without its commit" in log, log[-3000:]  # a commit was in flight: the case at hand
        assert took < CLOSE_TIMEOUT_S + 5, (took, log[-3000:])

        await asyncio.to_thread(broker.start)
        cluster.processor("next").start()
        await asyncio.sleep(3)
        load.stop()
        await driving
        verdict = await crash.verify(settings, url, load.acknowledged)
        assert verdict.ok, verdict
        assert verdict.acknowledged > 60
    finally:
        if cluster is not None:
            cluster.stop_all()
        await asyncio.to_thread(broker.stop)
