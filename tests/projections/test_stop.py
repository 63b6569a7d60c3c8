"""`esk project run --continuous` asked to stop as a supervisor asks (SIGTERM) in the middle
of a batch: the batch ends, its rows and its offsets are committed, and the process exits
cleanly, not killed with its JVM mid-write."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
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
from tests.system import system, wait_for

pytestmark = [pytest.mark.kafka, pytest.mark.spark]

REPO = Path(__file__).resolve().parents[2]
BATCH_STARTED = "ESK_TEST_BATCH_STARTED"  # a file the read model writes as a batch starts
BATCH_S = 4.0  # how long each batch then takes: the stop lands in the middle of it
[TOTALS] = USER_READ_MODELS


def _slow_totals(events: DataFrame, writer: esk.BatchWriter) -> int:
    Path(os.environ[BATCH_STARTED]).touch()
    time.sleep(BATCH_S)
    return TOTALS.apply(events, writer)


SLOW_READ_MODELS = [esk.Projection(TOTALS.model, TOTALS.columns, _slow_totals)]


async def test_a_stop_in_the_middle_of_a_batch_lets_the_batch_end_and_exits_cleanly(settings: Settings, tmp_path: Path) -> None:
    settings = settings.model_copy(
        update={
            "domain": "tests.counters:AGGREGATES",
            "read_models": f"{__name__}:SLOW_READ_MODELS",
            "projections": settings.projections.model_copy(update={"warehouse_dir": tmp_path / "warehouse"}),
        }
    )
    name = TOTALS.model.name
    tables = Tables(settings.projections.warehouse_dir)
    started = tmp_path / "batch-started"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ESK_")} | {
        "ESK_APP": settings.app,
        "ESK_KAFKA__BOOTSTRAP_SERVERS": settings.bootstrap_servers,
        "ESK_TOPICS__PARTITIONS": str(settings.topics.partitions),
        "ESK_DOMAIN": settings.domain,
        "ESK_READ_MODELS": settings.read_models,
        "ESK_PROJECTIONS__WAREHOUSE_DIR": str(settings.projections.warehouse_dir),
        "PYTHONPATH": str(REPO),
        BATCH_STARTED: str(started),
    }
    log_path = tmp_path / "project.log"
    async with system(settings) as s:
        assert (await s.client.post("/v1/counters/c1/start", json={})).status_code == 200
        with log_path.open("wb") as log:
            project = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "esk", "project", "run", name, "--continuous", env=env, stdout=log, stderr=subprocess.STDOUT
            )
        try:
            await wait_for(lambda: tables.current_generation(name) is not None, timeout_s=300, what="the table built")
            started.unlink()
            added = await s.client.post("/v1/counters/c1/add", json={"n": 5})
            assert added.status_code == 200, added.text
            await wait_for(started.exists, timeout_s=120, what="a batch with the add to start")
            project.send_signal(signal.SIGTERM)
            code = await asyncio.wait_for(project.wait(), 120)
        finally:
            if project.returncode is None:
                project.kill()
                await project.wait()
    output = log_path.read_text()
    assert code == 0, output
    assert "SIGTERM: stopping after the batch in flight" in output
    assert "stopped in the middle of a batch" not in output and "Traceback" not in output
    # the batch's rows are in the table, and its offsets are committed: a next run starts after it
    assert ReadModelRows(settings).read(name, {"counter_id": "c1"}, limit=10) == [{"counter_id": "c1", "total": 5, "version": 2}]
    position = added.json()["position"]
    reflected = read_model_positions(tables, name)
    assert reflected is not None and reflected[position["topic"], position["partition"]] >= position["offset"]
