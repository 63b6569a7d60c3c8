"""A processor that gives its partitions up while its broker is away (a stop, a rebalance)
waits for the commits in flight at most `close_timeout_ms`: a commit waits on its broker for
as long as the broker is away, and a SIGTERM during a 90 s outage was answered only when the
broker came back. Closed without them, nothing is lost or doubled: the next owner handles
their commands again. Against a broker of the test's own, killed and started again."""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from aiokafka.errors import ProducerFenced

from bench import crash
from bench.cluster import Cluster, api_ready, wait_until
from esk.broker import EmbeddedBroker
from esk.broker.ports import free_port_pair
from esk.kafka.topics import ensure_topics, topic_specs
from esk.processing.streams_producer import StreamsProducer
from esk.processing.task_manager import Partition, PartitionState
from esk.registry import load_registry
from esk.settings import BrokerSettings, Settings
from tests.conftest import own_settings

CLOSE_TIMEOUT_S = 3


@pytest.mark.kafka
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
        await asyncio.to_thread(wait_until, lambda: len(load.acknowledged) >= 40, 60, "accounts open")  # an open refused raises
        await asyncio.to_thread(broker.node.kill)
        await asyncio.sleep(1)  # the commits in flight wait on it now
        asked = time.monotonic()
        stopped.signal(signal.SIGTERM)
        await asyncio.to_thread(wait_until, lambda: not stopped.alive, 30, "the processor to stop")
        took = time.monotonic() - asked
        log = stopped.log_text()
        assert "closed at once, its commit or close not over" in log, log[-3000:]  # the bound was reached: the case at hand
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


async def test_a_commit_loop_that_abandons_its_own_partition_goes_on() -> None:
    """A failed commit's loop closes its partition (`TaskManager._fail`), and abandons it when
    that close outlasts the bound: it must not cancel itself, which left the partition
    neither closed nor started again."""

    class Producer:
        let_go_called = False

        def let_go(self) -> None:
            self.let_go_called = True

    partition, producer = Partition(0, "group"), Producer()
    partition.producer = producer  # type: ignore[assignment]  # what abandon asks of it

    async def commit_loop() -> str:
        partition.committing = asyncio.current_task()  # type: ignore[assignment]
        await partition.abandon()
        return "went on"

    assert await asyncio.wait_for(asyncio.create_task(commit_loop()), 5) == "went on"
    assert partition.state is PartitionState.CLOSED and producer.let_go_called


async def test_a_producer_let_go_whose_stop_is_fenced_closes_its_connections_and_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A producer let go with its commit's request in flight, which meets the next owner's
    fence (a review's repro, the order forced): aiokafka's stop raises ProducerFenced before
    it closes the connections, and the error was never retrieved."""
    producer = StreamsProducer(Settings(_env_file=None), "app.processor.0", "test")
    closed = []

    async def fenced() -> None:
        raise ProducerFenced()

    async def close() -> None:
        closed.append(True)

    real, producer._producer = producer._producer, SimpleNamespace(stop=fenced, client=SimpleNamespace(close=close))  # type: ignore[assignment]  # aiokafka's, stood in for
    await real.stop()  # never started: closed here, or its collection warns of an unclosed producer
    with caplog.at_level(logging.INFO, logger="esk.processing.streams_producer"):
        producer.let_go()
        await producer.stop()  # the stop under way, waited for
        gc.collect()
    assert closed == [True]
    assert "app.processor.0: its stop ended with ProducerFenced" in caplog.text
    assert "never retrieved" not in caplog.text
