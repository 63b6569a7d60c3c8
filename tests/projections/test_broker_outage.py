"""A continuous run outlives a broker that stays away longer than its Spark query waits for
one, whether it catches up or keeps up: the query gives up, the run waits for the broker,
and goes on from its checkpoint in the same driver, the events of meanwhile and after
reflected once each. A broker of the
test's own, stopped under the run, the processor and the API."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pyspark")

from esk.broker import EmbeddedBroker
from esk.broker.ports import free_port_pair
from esk.projections.reader import ReadModelRows
from esk.projections.runner import STOP_WAIT_S
from esk.settings import BrokerSettings, Settings
from tests.conftest import own_settings
from tests.projections.test_read_your_writes import USER_READ_MODELS
from tests.system import System, esk_env, esk_process, system, wait_for

pytestmark = [pytest.mark.kafka, pytest.mark.spark]

[TOTALS] = USER_READ_MODELS
NAME = TOTALS.model.name


def _rows(settings: Settings) -> list[dict[str, Any]]:
    try:
        return ReadModelRows(settings).read(NAME, {"counter_id": "c1"}, limit=10)
    except Exception:  # not built yet
        return []


def _gave_up(log: Path) -> int:
    return log.read_text().count("no Kafka broker answered")


async def _add(s: System, n: int) -> None:
    """Sent until the API takes it (503 while its broker is still on its way back)."""
    key = f"add-{n}"
    for _ in range(60):
        r = await s.client.post("/v1/counters/c1/add", json={"n": n}, headers={"Idempotency-Key": key})
        if r.status_code == 200:
            return
        assert r.status_code == 503, r.text
        await asyncio.sleep(1)
    raise AssertionError("the API took no command for a minute")


async def test_a_continuous_run_goes_on_after_the_broker_was_away_for_longer_than_its_query_waits(tmp_path: Path) -> None:
    broker = EmbeddedBroker(BrokerSettings(port=free_port_pair(), data_dir=tmp_path / "broker"))
    await asyncio.to_thread(broker.start)
    try:
        settings = own_settings(broker, tmp_path)
        settings = settings.model_copy(
            update={
                "domain": "tests.counters:AGGREGATES",
                "read_models": "tests.projections.test_read_your_writes:USER_READ_MODELS",
                "projections": settings.projections.model_copy(update={"warehouse_dir": tmp_path / "warehouse"}),
            }
        )
        log = tmp_path / "project.log"
        async with system(settings) as s:
            assert (await s.client.post("/v1/counters/c1/start", json={})).status_code == 200
            await _add(s, 1)
            # Its Spark clients wait 2 s per request: the query gives up after a few.
            env = esk_env(settings, ESK_KAFKA__REQUEST_TIMEOUT_MS="2000")
            # Away as the run starts: it waits for a broker.
            await asyncio.to_thread(broker.stop)
            async with esk_process(["project", "run", NAME, "--continuous"], env, log) as project:
                await wait_for(lambda: "waiting for one" in log.read_text(), timeout_s=120, what="the run to wait")
                await asyncio.to_thread(broker.start)
                # Away again as its Spark starts: the catch-up's query gives up, and the run
                # goes on once the broker is back.
                await wait_for(lambda: "answers: starting" in log.read_text(), timeout_s=120, what="the run to start")
                await asyncio.to_thread(broker.stop)
                await wait_for(lambda: _gave_up(log) == 1, timeout_s=300, what="the catch-up to give up")
                assert _rows(settings) == [] and project.returncode is None, log.read_text()
                await asyncio.to_thread(broker.start)
                await wait_for(lambda: [r["total"] for r in _rows(settings)] == [1], timeout_s=300, what="the first row")
                # Away while it keeps up.
                await asyncio.to_thread(broker.stop)
                await wait_for(lambda: _gave_up(log) == 2, timeout_s=120, what="the query to give up")
                await asyncio.sleep(2)  # the run waits for a broker
                assert project.returncode is None, log.read_text()
                await asyncio.to_thread(broker.start)
                await _add(s, 2)
                await wait_for(lambda: [r["total"] for r in _rows(settings)] == [3], timeout_s=120, what="the row after the outage")
                assert project.returncode is None, log.read_text()
                # Stopped while its query asks an absent broker for offsets: it ends within
                # the stop's bounds (not after the query's Kafka requests time out).
                await asyncio.to_thread(broker.stop)
                await asyncio.sleep(1)
                project.send_signal(signal.SIGTERM)
                stopping = time.monotonic()
                code = await asyncio.wait_for(project.wait(), 120)
                assert time.monotonic() - stopping < STOP_WAIT_S, log.read_text()
        output = log.read_text()
        assert code == 0, output
        assert "Kafka answers again: going on" in output
        assert "Traceback" not in output and "failed" not in output, output
        assert "could not be established" not in output  # each of Spark's Kafka clients, every second
    finally:
        await asyncio.to_thread(broker.stop)
