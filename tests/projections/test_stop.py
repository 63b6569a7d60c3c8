"""`esk project run` asked to stop as a supervisor asks (SIGTERM), or Ctrl-C (SIGINT), in the middle of a batch:
the batch ends, its rows and its offsets are committed, and the process exits cleanly, not
killed with its JVM mid-write. A run stopped before it caught up says so, and readers stay
where they were."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

pytest.importorskip("pyspark")

from pyspark.sql import DataFrame

import esk
from esk.projections.catalog import Tables
from esk.projections.positions import read_model_positions
from esk.projections.reader import ReadModelRows
from esk.settings import Settings
from tests.projections.test_read_your_writes import USER_READ_MODELS
from tests.system import System, esk_env, esk_process, system, wait_for

pytestmark = [pytest.mark.kafka, pytest.mark.spark]

BATCH_STARTED = "TEST_BATCH_STARTED"  # a file the read model writes as a batch starts
BATCH_S = 4.0  # how long each batch then takes: the stop lands in the middle of it
[TOTALS] = USER_READ_MODELS
NAME = TOTALS.model.name


def _slow_totals(events: DataFrame, writer: esk.BatchWriter) -> int:
    if not writer.planning:  # the run's start plans it over no events: not a batch
        Path(os.environ[BATCH_STARTED]).touch()
        time.sleep(BATCH_S)
    return TOTALS.apply(events, writer)


SLOW_READ_MODELS = [esk.Projection(TOTALS.model, TOTALS.columns, _slow_totals)]


def _settings(settings: Settings, tmp_path: Path) -> Settings:
    return settings.model_copy(
        update={
            "domain": "tests.counters:AGGREGATES",
            "read_models": f"{__name__}:SLOW_READ_MODELS",
            "projections": settings.projections.model_copy(update={"warehouse_dir": tmp_path / "warehouse"}),
        }
    )


async def _stopped_in_a_batch(
    s: System, tmp_path: Path, args: tuple[str, ...], before: Callable[[Path], Awaitable[None]],
    stop_signal: signal.Signals = signal.SIGTERM, **env: str,
) -> tuple[int, str]:
    """Runs `esk project run NAME *args` as a process; once `before(started)` returned and
    a batch has started, sends it `stop_signal`. Its exit code and output."""
    started = tmp_path / "batch-started"
    variables = esk_env(s.settings, **{BATCH_STARTED: str(started)}, **env)
    log = tmp_path / "project.log"
    async with esk_process(["project", "run", NAME, *args], variables, log) as project:
        await before(started)
        await wait_for(started.exists, timeout_s=300, what="a batch with events to start")
        project.send_signal(stop_signal)
        code = await asyncio.wait_for(project.wait(), 120)
    return code, log.read_text()


# Ctrl-C here, SIGTERM in the test below: the SparkContext sets a handler of its own for
# SIGINT, which cancels every job.
async def test_a_ctrl_c_in_the_middle_of_a_batch_lets_the_batch_end_and_exits_cleanly(settings: Settings, tmp_path: Path) -> None:
    stop_signal = signal.SIGINT
    settings = _settings(settings, tmp_path)
    tables = Tables(settings.projections.warehouse_dir)
    async with system(settings) as s:
        assert (await s.client.post("/v1/counters/c1/start", json={})).status_code == 200
        positions: list[dict[str, str | int]] = []

        async def add_once_caught_up(started: Path) -> None:
            await wait_for(lambda: tables.current_generation(NAME) is not None, timeout_s=300, what="the table built")
            await asyncio.to_thread(started.unlink)
            added = await s.client.post("/v1/counters/c1/add", json={"n": 5})
            assert added.status_code == 200, added.text
            positions.append(added.json()["position"])

        code, output = await _stopped_in_a_batch(s, tmp_path, ("--continuous",), add_once_caught_up, stop_signal)
    assert code == 0, output
    assert f"{stop_signal.name}: stopping after the batch in flight" in output
    assert "stopped in the middle of a batch" not in output and "Traceback" not in output
    assert "Failed to cancel job group" not in output  # Spark's warning about nothing, at each stop
    # the batch's rows are in the table, and its offsets are committed: a next run starts after it
    assert ReadModelRows(settings).read(NAME, {"counter_id": "c1"}, limit=10) == [{"counter_id": "c1", "total": 5, "version": 2}]
    [position] = positions
    reflected = read_model_positions(tables, NAME)
    assert reflected is not None and reflected[str(position["topic"]), int(position["partition"])] >= int(position["offset"])


async def test_a_stop_before_the_catch_up_ends_leaves_readers_where_they_were(settings: Settings, tmp_path: Path) -> None:
    settings = _settings(settings, tmp_path)
    async with system(settings) as s:
        for command, body in (("start", {}), ("add", {"n": 1}), ("add", {"n": 2})):
            assert (await s.client.post(f"/v1/counters/c1/{command}", json=body)).status_code == 200

        async def nothing(_started: Path) -> None:
            pass

        # One offset a batch: the stop lands in the first of several.
        code, output = await _stopped_in_a_batch(s, tmp_path, (), nothing, ESK_PROJECTIONS__MAX_OFFSETS_PER_TRIGGER="1")
    assert code == 1, output
    assert "stopped before it caught up; readers stay where they were" in output
    # the first batch ended; the next one, already started, is cut short at its start,
    # quietly (it runs again at the next start)
    assert "batch 0: 1 events" in output and "stopped in the middle of a batch" not in output
    assert "Traceback" not in output and "Exception in thread" not in output and "ERROR" not in output
    assert Tables(settings.projections.warehouse_dir).current_generation(NAME) is None
