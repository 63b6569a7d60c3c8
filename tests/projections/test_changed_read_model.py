"""A read model whose code changed (its columns, or its ReadModel.version raised for a fix)
against a table built by the older code: a one-shot run is refused, naming the change; a
continuous run builds a new generation from the events while readers keep the old one, then
switches them and keeps the new one up; the old one goes once readers have left it."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

pytest.importorskip("pyspark")

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

import esk
from esk.projections.catalog import Tables
from esk.projections.positions import Positions, read_model_positions
from esk.projections.reader import ReadModelRows
from esk.projections.runner import (
    HAND_OVER_WAIT_S,
    BuiltByOtherCode,
    ReadModelChanged,
    ReadModelInvalid,
    RunFailed,
    StopRequest,
    run,
)
from esk.settings import Settings
from tests.counters import Added, counters
from tests.projections.test_read_your_writes import USER_READ_MODELS, users_settings
from tests.system import esk_env, system, wait_for

pytestmark = [pytest.mark.kafka, pytest.mark.spark]

[TOTALS] = USER_READ_MODELS
NAME = TOTALS.model.name


def _tenfold_totals(events: DataFrame, writer: esk.BatchWriter) -> int:
    """The read model's version 2: its totals counted otherwise, in the same columns."""
    rows = (
        events.filter(esk.of(counters))
        .groupBy(F.col("aggregate_id").alias("counter_id"))
        .agg(F.sum(F.coalesce(esk.payload(counters, Added)["n"] * 10, F.lit(0))).alias("total"), F.max("version").alias("version"))
    )
    return writer.merge(
        rows,
        esk.Merge(on="t.counter_id = s.counter_id", update={"total": "t.total + s.total", "version": "s.version"}, update_if="s.version > t.version"),
    )


def _doubling_totals(events: DataFrame, writer: esk.BatchWriter) -> int:
    """Its Merge changed (each batch's total doubled as merged), its version not."""
    rows = events.filter(esk.of(counters)).groupBy(F.col("aggregate_id").alias("counter_id")).agg(
        F.sum(F.coalesce(esk.payload(counters, Added)["n"], F.lit(0))).alias("total"), F.max("version").alias("version")
    )
    return writer.merge(
        rows,
        esk.Merge(on="t.counter_id = s.counter_id", update={"total": "t.total + 2 * s.total", "version": "s.version"}, update_if="s.version > t.version"),
    )


VERSION_2 = esk.Projection(replace(TOTALS.model, version=2), TOTALS.columns, _tenfold_totals)


async def test_a_changed_read_model_is_refused_one_shot_and_built_again_by_a_continuous_run(
    settings: Settings, spark: SparkSession, tmp_path: Path, runner_said: Callable[[], str]
) -> None:
    settings = users_settings(settings, tmp_path, old_generations_kept_s=0)
    tables = Tables(settings.projections.warehouse_dir)
    rows = ReadModelRows(settings)
    async with system(settings) as s:
        for command, body in (("start", {}), ("add", {"n": 2})):
            assert (await s.client.post(f"/v1/counters/c1/{command}", json=body)).status_code == 200
        await asyncio.to_thread(run, settings, TOTALS, spark=spark)
        assert tables.current_generation(NAME) == 1

        # its Merge changed, its columns and version not: refused, continuous or not (the
        # version tells which code is newer; two drivers would rebuild it by turns)
        same_version = esk.Projection(TOTALS.model, TOTALS.columns, _doubling_totals)
        for continuous in (False, True):
            with pytest.raises(ReadModelInvalid, match=r"its writes are not those its table at .* was built with"):
                await asyncio.to_thread(run, settings, same_version, continuous, spark=spark)
        assert tables.current_generation(NAME) == 1

        with pytest.raises(ReadModelChanged, match=r"is not what the read model declares \(version 1, now 2\)$"):
            await asyncio.to_thread(run, settings, VERSION_2, spark=spark)
        assert tables.current_generation(NAME) == 1

        stop = StopRequest()
        continuous = threading.Thread(target=run, args=(settings, VERSION_2, True), kwargs={"spark": spark, "stop": stop})
        continuous.start()
        try:
            await wait_for(lambda: tables.current_generation(NAME) == 2, timeout_s=300, what="readers switched to generation 2")
            assert rows.read(NAME, {"counter_id": "c1"}, limit=10) == [{"counter_id": "c1", "total": 20, "version": 2}]
            # kept up from then on
            assert (await s.client.post("/v1/counters/c1/add", json={"n": 1})).status_code == 200
            await wait_for(
                lambda: rows.read(NAME, {"counter_id": "c1"}, limit=10) == [{"counter_id": "c1", "total": 30, "version": 3}],
                timeout_s=120, what="the next command in generation 2",
            )
        finally:
            stop.asked.set()
            await asyncio.to_thread(continuous.join, 120)
        assert not continuous.is_alive()
    output = runner_said()
    assert (
        f"{NAME}: generation 1 was built by another version of the read model (version 1, now 2): building generation 2 "
        "from the earliest offsets; readers stay on 1 until it has caught up"
    ) in output
    assert f"{NAME}: removed generation(s) 1, which readers left" in output
    assert tables.generations(NAME) == [2]


async def test_a_run_of_older_code_that_follows_a_rebuild_is_refused_not_built_back(
    settings: Settings, spark: SparkSession, tmp_path: Path
) -> None:
    """`esk dev`'s driver, of the code it started with, and a `--rebuild` of changed code beside
    it: the driver follows readers to the new generation, finds it built otherwise, and is
    refused (its supervisor starts it again with the code there is now). Were it to build
    again from its own code, it would move readers back, and two drivers of two codes would
    take turns rebuilding for ever."""
    settings = users_settings(settings, tmp_path)
    tables = Tables(settings.projections.warehouse_dir)
    async with system(settings) as s:
        assert (await s.client.post("/v1/counters/c1/start", json={})).status_code == 200
        stop = StopRequest()
        failed: list[BaseException] = []

        def older_driver() -> None:
            try:
                run(settings, TOTALS, True, spark=spark, stop=stop)
            except BaseException as error:  # the thread's end: what the supervisor would see
                failed.append(error)

        driver = threading.Thread(target=older_driver)
        driver.start()
        try:
            await wait_for(lambda: tables.current_generation(NAME) == 1, timeout_s=300, what="the older driver's first build")
            await asyncio.to_thread(run, settings, VERSION_2, False, True, spark=spark)  # the rebuild beside it
            assert tables.current_generation(NAME) == 2
            await asyncio.to_thread(driver.join, 120)
        finally:
            stop.asked.set()
            await asyncio.to_thread(driver.join, 120)
    assert len(failed) == 1 and isinstance(failed[0], BuiltByOtherCode), failed
    # told as what it is, not as a read model that needs the rebuild just run
    assert str(RunFailed(NAME, failed[0])) == (
        f"{NAME}: readers were moved to generation 2, built by other code than this run's (version 2, now 1): this run ends, "
        "and started again (as esk dev starts its driver) runs the code as it is then"
    )
    assert RunFailed(NAME, failed[0]).told_in_a_line  # the spark-submit job prints it, no traceback
    assert not RunFailed(NAME, RuntimeError("a bug")).told_in_a_line
    assert tables.current_generation(NAME) == 2 and 3 not in tables.generations(NAME)


async def test_a_rebuild_beside_readers_takes_the_catch_up_turn_a_batch_at_a_time(
    settings: Settings, spark: SparkSession, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A driver keeping two read models, one of them changed: its rebuild from the earliest
    offsets (hours, on a big topic) must not keep the other's catch-up waiting to its end."""
    from esk.projections import runner
    from tests.projections.test_run_several import ADDS

    monkeypatch.setattr(runner, "REBUILD_BESIDE_BATCH_MAX", 1)  # a rebuild of many batches
    settings = users_settings(settings, tmp_path)
    tables = Tables(settings.projections.warehouse_dir)
    async with system(settings) as s:
        assert (await s.client.post("/v1/counters/c1/start", json={})).status_code == 200
        for _ in range(10):
            assert (await s.client.post("/v1/counters/c1/add", json={"n": 1})).status_code == 200
        await asyncio.to_thread(run, settings, TOTALS, spark=spark)  # generation 1, of the older code
        stop = StopRequest()
        driver = threading.Thread(
            target=runner.run_several, args=(settings, [VERSION_2, ADDS], True), kwargs={"stop": stop}
        )
        driver.start()
        try:
            await wait_for(lambda: tables.current_generation(ADDS.model.name) == 1, timeout_s=300, what="the other read model caught up")
            assert tables.current_generation(NAME) == 1  # its rebuild still on its way, a batch at a time
            await wait_for(lambda: tables.current_generation(NAME) == 2, timeout_s=300, what="the rebuild's switch")
        finally:
            stop.asked.set()
            await asyncio.to_thread(driver.join, 120)
    assert ReadModelRows(settings).read(NAME, {"counter_id": "c1"}, limit=1) == [{"counter_id": "c1", "total": 100, "version": 11}]


async def test_a_rebuild_beside_a_continuous_run_is_taken_over_by_it_and_readers_never_go_back(
    settings: Settings, spark: SparkSession, tmp_path: Path, runner_said: Callable[[], str]
) -> None:
    """`esk project run NAME --rebuild` beside a continuous run of the same code (esk dev's
    driver), commands coming in: switched by the rebuild, readers would see rows and
    positions older than they had seen, as the continuous run wrote on meanwhile. The
    rebuild offers its generation instead; the continuous run stops its own, brings the new
    one to where its own stood, switches readers, and keeps it up."""
    settings = users_settings(settings, tmp_path)
    tables = Tables(settings.projections.warehouse_dir)
    seen: list[Positions] = []
    generations: set[int | None] = set()
    sampled = threading.Event()

    def sample() -> None:  # what a reader's read says it reflects, as often as a busy reader asks
        while not sampled.is_set():
            if positions := read_model_positions(tables, NAME):
                seen.append(positions)
                generations.add(tables.current_generation(NAME))
            time.sleep(0.01)

    async with system(settings) as s:

        async def add() -> int:
            answer = await s.client.post("/v1/counters/c1/add", json={"n": 1})
            assert answer.status_code == 200
            return int(answer.json()["version"])

        async def keep_adding() -> None:
            while True:
                await add()
                await asyncio.sleep(0.05)

        assert (await s.client.post("/v1/counters/c1/start", json={})).status_code == 200
        stop = StopRequest()
        continuous = threading.Thread(target=run, args=(settings, TOTALS, True), kwargs={"spark": spark, "stop": stop})
        continuous.start()
        sampler = threading.Thread(target=sample)
        try:
            await wait_for(lambda: tables.current_generation(NAME) == 1, timeout_s=300, what="the continuous run's first build")
            sampler.start()
            adding = asyncio.create_task(keep_adding())
            try:  # an operator's, in a driver of its own (in this one, it would hold up the continuous run's batches)
                rebuilt = await asyncio.to_thread(
                    subprocess.run, [sys.executable, "-m", "esk", "project", "run", NAME, "--rebuild"],
                    env=esk_env(settings), cwd=tmp_path, capture_output=True, text=True, timeout=300,
                )  # fmt: skip
            finally:
                adding.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await adding
            assert rebuilt.returncode == 0, rebuilt.stderr
            assert f"{NAME}: readers now use generation 2, switched by the run that took it over" in rebuilt.stderr, rebuilt.stderr
            assert tables.current_generation(NAME) == 2
            version = await add()  # and the continuous run keeps the new generation up
            rows = ReadModelRows(settings)
            await wait_for(lambda: rows.read(NAME, {"counter_id": "c1"}, limit=1)[0]["version"] == version, timeout_s=60, what="the row")
            assert rows.read(NAME, {"counter_id": "c1"}, limit=1)[0]["total"] == version - 1
        finally:
            sampled.set()
            stop.asked.set()
            await asyncio.to_thread(continuous.join, 120)
            if sampler.is_alive():
                await asyncio.to_thread(sampler.join, 10)
    assert len(seen) > 10 and generations == {1, 2}, (len(seen), generations)
    went_back = [(before, after) for before, after in itertools.pairwise(seen) if any(after.get(k, 0) < v for k, v in before.items())]
    assert not went_back, went_back[:3]
    assert f"{NAME}: taking over generation 2, rebuilt beside this run" in runner_said()


async def test_a_rebuild_beside_a_one_shot_run_switches_readers_once_that_run_has_ended(
    settings: Settings, spark: SparkSession, tmp_path: Path, runner_said: Callable[[], str]
) -> None:
    """A one-shot run keeping readers' generation takes no offer: the rebuild offers it none
    and switches readers as soon as that run lets go of the generation (not while it may
    still write it, nor a minute later)."""
    settings = users_settings(settings, tmp_path)
    tables = Tables(settings.projections.warehouse_dir)
    async with system(settings) as s:
        assert (await s.client.post("/v1/counters/c1/start", json={})).status_code == 200
        assert (await s.client.post("/v1/counters/c1/add", json={"n": 4})).status_code == 200
    await asyncio.to_thread(run, settings, TOTALS, spark=spark)
    assert tables.current_generation(NAME) == 1
    one_shot = tables.run_lock(NAME, 1)  # as a one-shot run holds it: it says it takes no offers
    one_shot.acquire()
    rebuild = asyncio.create_task(asyncio.to_thread(run, settings, TOTALS, rebuild=True, spark=spark))
    try:
        await wait_for(
            lambda: f"{NAME}: generation 2 has caught up; a one-shot run writes generation 1" in runner_said() or rebuild.done(),
            timeout_s=300, what="the rebuild's catch-up",
        )  # fmt: skip
        assert not rebuild.done(), runner_said()
        await asyncio.sleep(1)
        assert tables.current_generation(NAME) == 1 and tables.offered(NAME) is None
    finally:
        one_shot.release()
    ended = time.monotonic()
    summary = await asyncio.wait_for(rebuild, 60)
    assert time.monotonic() - ended < HAND_OVER_WAIT_S / 3
    assert summary.caught_up and tables.current_generation(NAME) == 2
    assert ReadModelRows(settings).read(NAME, {"counter_id": "c1"}, limit=1) == [{"counter_id": "c1", "total": 4, "version": 2}]
