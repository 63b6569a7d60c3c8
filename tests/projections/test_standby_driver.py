"""A continuous run standing by (another run keeps its generation) whose Spark driver died
(its JVM killed, for memory say) ends, in a line, as soon as it notices: it waited on,
silent, and failed only at the take-over, with a ConnectionRefusedError, just when the read
model needed it (a chaos audit's find). Its supervisor then starts it again."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import psutil
import pytest

pytest.importorskip("pyspark")

from esk.projections.catalog import Tables
from esk.settings import Settings
from tests.projections.test_read_your_writes import USER_READ_MODELS
from tests.system import esk_env, esk_process, wait_for

pytestmark = pytest.mark.spark

[TOTALS] = USER_READ_MODELS
NAME = TOTALS.model.name


def _jvm_of(pid: int) -> psutil.Process:
    [jvm] = [p for p in psutil.Process(pid).children(recursive=True) if p.name() == "java"]
    return jvm


async def test_a_standby_whose_driver_died_ends_in_a_line_not_at_its_take_over(settings: Settings, tmp_path: Path) -> None:
    settings = settings.model_copy(
        update={
            "domain": "tests.counters:AGGREGATES",
            "read_models": "tests.projections.test_read_your_writes:USER_READ_MODELS",
            "projections": settings.projections.model_copy(update={"warehouse_dir": tmp_path / "warehouse"}),
        }
    )
    kept = Tables(settings.projections.warehouse_dir).run_lock(NAME, 1)  # another run keeps generation 1
    kept.acquire()
    try:
        log = tmp_path / "standby.log"
        async with esk_process(["project", "run", NAME, "--continuous"], esk_env(settings), log) as standby:
            standing_by = f"{NAME}: waiting for generation 1, which another run keeps"
            await wait_for(lambda: standing_by in log.read_text(), timeout_s=300, what="the run to stand by")
            _jvm_of(standby.pid).send_signal(signal.SIGKILL)
            code = await asyncio.wait_for(standby.wait(), 60)
        output = log.read_text()
    finally:
        kept.release()
    assert code != 0, output
    assert f"{NAME}: the Spark driver this run started no longer answers" in output, output
    assert "Traceback" not in output, output
