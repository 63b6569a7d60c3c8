"""Parked aggregates: an event that fails a read model's batch is found, and its aggregate
held back from there, while every other aggregate goes on; how the event is found (pure),
and a user's read model that fails on one event, against the real broker and Spark."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from esk.projections.parking import (
    PARKED_PER_BATCH_MAX,
    SAME_FAILURE_MAX,
    ParkedAggregate,
    ParkedAggregates,
    Prefix,
    Span,
    first_failing,
    held_back,
)

# -- finding the event (pure) ----------------------------------------------------------


def _fails_on(poison: set[tuple[int, int]], probes: list[Prefix]) -> Callable[[Prefix], bool]:
    """A batch that fails when it holds an event of `poison` (span index, offset)."""

    def fails(prefix: Prefix) -> bool:
        probes.append(prefix)
        return any(i < prefix.index or (i == prefix.index and offset <= prefix.offset) for i, offset in poison)

    return fails


SPANS = (Span("orders", 0, 100, 1099), Span("orders", 1, 0, 9), Span("orders", 2, 50, 50), Span("users", 0, 7, 500_006))


@pytest.mark.parametrize(
    ("poison", "found"),
    [
        ({(0, 100)}, (0, 100)),  # the batch's very first event
        ({(3, 500_006)}, (3, 500_006)),  # its last
        ({(2, 50)}, (2, 50)),  # a partition of one event
        ({(1, 4), (3, 9000), (0, 1099)}, (0, 1099)),  # several: the first, in the spans' order
        ({(3, 123_456), (3, 123_457)}, (3, 123_456)),
    ],
)
def test_the_first_failing_event_is_found_by_bisection(poison: set[tuple[int, int]], found: tuple[int, int]) -> None:
    probes: list[Prefix] = []
    prefix = first_failing(SPANS, _fails_on(poison, probes))
    assert prefix is not None and (prefix.index, prefix.offset) == found
    # the whole batch, then log2 of the spans and of the span's offsets, not an event at a time
    assert len(probes) <= 1 + 2 + 19, len(probes)


def test_a_batch_that_does_not_fail_as_a_whole_has_no_failing_event() -> None:
    probes: list[Prefix] = []
    assert first_failing(SPANS, _fails_on(set(), probes)) is None
    assert len(probes) == 1
    assert first_failing((), _fails_on({(0, 0)}, [])) is None


def test_parked_aggregates_are_kept_per_batch_and_written_again_as_the_same(tmp_path: Path) -> None:
    parking = ParkedAggregates(tmp_path / "g1")
    assert parking.load() == []
    first = ParkedAggregate("orders", "o-7", 2, 41, "Placed", "ValueError: no such status", batch_id=3)
    second = ParkedAggregate("orders", "o-9", 0, 17, "Shipped", "[DIVIDE_BY_ZERO] Division by zero", batch_id=12)
    parking.add(12, [second])
    parking.add(3, [first])
    parking.add(3, [first])  # the batch ran again after a crash
    assert parking.load() == [first, second]  # in the batches' order
    assert not list((tmp_path / "g1" / "esk-parked").glob("*.tmp"))


# -- a user's read model that fails on one event (Kafka and Spark) ----------------------


pyspark = pytest.importorskip("pyspark")

from aiokafka import AIOKafkaProducer  # noqa: E402
from pyspark.sql import Column, DataFrame, SparkSession  # noqa: E402
from pyspark.sql import functions as F  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

import esk  # noqa: E402
from esk.cli import cli  # noqa: E402
from esk.kafka.client_options import client_options  # noqa: E402
from esk.projections import runner  # noqa: E402
from esk.projections.catalog import Probe, Tables  # noqa: E402
from esk.projections.positions import Position  # noqa: E402
from esk.projections.reader import ReadModelNotBuilt, ReadModelRows  # noqa: E402
from esk.projections.runner import EventsNewerThanCode, RunFailed, StopRequest, _told_in_full, run, run_several  # noqa: E402
from esk.projections.session import QUERY_FAILURE_LOGGER, loggers_off  # noqa: E402
from esk.settings import Settings  # noqa: E402
from tests.counters import Added, counters  # noqa: E402
from tests.projections.settings import counters_settings  # noqa: E402
from tests.system import esk_env, events_topic, system  # noqa: E402

UNLUCKY = 13


def _lucky_totals(events: DataFrame, writer: esk.BatchWriter) -> int:
    """Each counter's total, for a read model that cannot take an addition of 13 (Spark
    raises on that row, as it does on a cast ANSI SQL refuses, or a division by zero)."""
    return _totals(events, writer, lambda n: F.when(n == UNLUCKY, F.raise_error(F.lit("13 is not a number this read model takes"))))


def _totals(events: DataFrame, writer: esk.BatchWriter, refused: Callable[[Column], Column]) -> int:
    """Each counter's total, of the numbers added that `refused` gives no value of its own
    (it may raise on them)."""
    n = esk.payload(counters, Added)["n"]
    checked = F.coalesce(refused(n), n)
    rows = (
        events.filter(esk.of(counters))
        .groupBy(F.col("aggregate_id").alias("counter_id"))
        .agg(F.sum(F.coalesce(checked, F.lit(0))).alias("total"), F.max("version").alias("version"))
    )
    return writer.merge(
        rows,
        esk.Merge(on="t.counter_id = s.counter_id", update={"total": "t.total + s.total", "version": "s.version"}, update_if="s.version > t.version"),
    )


READ_MODELS = [
    esk.Projection(
        esk.ReadModel("lucky_totals", (counters,), "each counter's total, 13s refused", order_by=("counter_id",)),
        "counter_id STRING, total BIGINT, version BIGINT",
        _lucky_totals,
    )
]
[LUCKY] = READ_MODELS


def _lucky_adds(events: DataFrame, writer: esk.BatchWriter) -> int:
    """Each addition a row, 13 refused: Spark raises in the stage that writes the rows (no
    shuffle before it), where a failed task aborts its write."""
    n = esk.payload(counters, Added)["n"]
    refused = F.when(n == UNLUCKY, F.raise_error(F.lit("13 is not a number this read model takes")))
    rows = events.filter(esk.is_event(counters, Added)).select(F.col("event_id"), F.coalesce(refused, n).alias("n"))
    return writer.append(rows)


# ESK_READ_MODELS=tests.projections.test_parking:WRITE_STAGE_READ_MODELS
WRITE_STAGE_READ_MODELS = [
    esk.Projection(esk.ReadModel("lucky_adds", (counters,), "each addition, 13s refused"), "event_id STRING, n BIGINT", _lucky_adds)
]


def _counters_settings(settings: Settings, tmp_path: Path, **projections: object) -> Settings:
    return counters_settings(settings, tmp_path, f"{__name__}:READ_MODELS", **projections)


@pytest.mark.spark
def test_held_back_are_a_parked_aggregates_events_from_its_parked_one_on_and_nothing_else(spark: SparkSession) -> None:
    events = spark.createDataFrame(
        [("counters", "c2", 0, 3), ("counters", "c2", 0, 4), ("counters", "c2", 0, 9), ("counters", "c1", 0, 5),
         ("users", "c2", 0, 6), (None, None, 0, 7)],  # another type's c2; a record that does not decode
        "aggregate_type string, aggregate_id string, kafka_partition int, kafka_offset bigint",
    )
    parked = [ParkedAggregate("counters", "c2", 0, 4, "Added", "failed", batch_id=0)]
    kept = events.filter(~held_back(parked)).orderBy("kafka_offset").collect()
    assert [(r.aggregate_type, r.aggregate_id, r.kafka_offset) for r in kept] == [
        ("counters", "c2", 3), ("counters", "c1", 5), ("users", "c2", 6), (None, None, 7)
    ]
    assert events.filter(~held_back([])).count() == 6


@pytest.mark.kafka
@pytest.mark.spark
@pytest.mark.parametrize("on_driver", [True, False], ids=["delta-rs", "spark-merge"])
async def test_an_event_that_fails_the_read_model_parks_its_aggregate_and_the_others_go_on(
    settings: Settings, spark: SparkSession, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, on_driver: bool,
    runner_said: Callable[[], str],
) -> None:
    settings = _counters_settings(settings, tmp_path, driver_write_max_events=20_000 if on_driver else 0)
    rows = ReadModelRows(settings)
    tables = Tables(settings.projections.warehouse_dir)
    async with system(settings) as s:

        async def send(counter: str, command: str, body: dict[str, int]) -> None:
            assert (await s.client.post(f"/v1/counters/{counter}/{command}", json=body)).status_code == 200

        for counter in ("c1", "c2", "c3", "c4"):
            await send(counter, "start", {})
        for counter, n in (("c1", 2), ("c2", 5), ("c2", UNLUCKY), ("c2", 1), ("c3", 4), ("c4", UNLUCKY)):
            await send(counter, "add", {"n": n})
        await asyncio.to_thread(run, settings, LUCKY, spark=spark)

        everything = {r["counter_id"]: (r["total"], r["version"]) for r in rows.read("lucky_totals", {}, limit=10)}
        # c2 up to its 13 (its start and its 5), c4 up to its 13 (its start); the others whole
        assert everything == {"c1": (2, 2), "c2": (5, 2), "c3": (4, 2), "c4": (0, 1)}, runner_said()
        parked = rows.parked("lucky_totals")
        assert sorted((p.aggregate_id, p.event_type, p.batch_id) for p in parked) == [("c2", "Added", 0), ("c4", "Added", 0)]
        assert all("13 is not a number this read model takes" in p.reason for p in parked), parked
        assert tables.parked("lucky_totals", 1).load() == parked
        # a reader over HTTP is told which aggregates' rows stop short, whatever the positions
        r = await s.client.get("/v1/projections/lucky_totals", params={"counter_id": "c2"})
        assert r.status_code == 200 and r.json()["rows"] == [{"counter_id": "c2", "total": 5, "version": 2}], r.text
        assert sorted((p["aggregate_type"], p["aggregate_id"]) for p in r.json()["parked"]) == [("counters", "c2"), ("counters", "c4")], r.text

        # the next batch: a parked aggregate's later events stay out, the others' go in
        await send("c2", "add", {"n": 100})
        await send("c1", "add", {"n": 10})
        await asyncio.to_thread(run, settings, LUCKY, spark=spark)
        everything = {r["counter_id"]: (r["total"], r["version"]) for r in rows.read("lucky_totals", {}, limit=10)}
        assert everything == {"c1": (12, 3), "c2": (5, 2), "c3": (4, 2), "c4": (0, 1)}, runner_said()
        assert len(rows.parked("lucky_totals")) == 2  # parked once, not again

        # the same failure once more, in a batch of its own: a one-off still, parked
        await send("c5", "start", {})
        await send("c5", "add", {"n": UNLUCKY})
        await asyncio.to_thread(run, settings, LUCKY, spark=spark)
        assert sorted(p.aggregate_id for p in rows.parked("lucky_totals")) == ["c2", "c4", "c5"]
        # and again: SAME_FAILURE_MAX times the same failure on Added is the read model's
        await send("c6", "start", {})
        await send("c6", "add", {"n": UNLUCKY})
        with pytest.raises(Exception, match="13 is not a number this read model takes"):
            await asyncio.to_thread(run, settings, LUCKY, spark=spark)
        assert len(rows.parked("lucky_totals")) == SAME_FAILURE_MAX

    output = runner_said()
    assert "lucky_totals g1 batch 0 failed (" in output and "looking for the event that fails it" in output
    assert "lucky_totals g1: parked counters 'c2': its Added at partition" in output
    # each run after says so at its start, and what takes them in again
    assert "lucky_totals g1 holds 2 parked aggregates back (`esk project parked lucky_totals`): only a rebuild" in output
    assert "lucky_totals g1 holds 3 parked aggregates back" in output

    # what an operator sees
    for name, value in {
        "ESK_APP": settings.app,
        "ESK_DOMAIN": settings.domain,
        "ESK_READ_MODELS": settings.read_models,
        "ESK_PROJECTIONS__WAREHOUSE_DIR": str(settings.projections.warehouse_dir),
        "COLUMNS": "250",
    }.items():
        monkeypatch.setenv(name, value)
    listed = CliRunner().invoke(cli, ["project", "parked", "lucky_totals", "--format", "csv"])
    assert listed.exit_code == 0, listed.output
    lines = listed.output.splitlines()
    assert lines[0] == "aggregate_type,aggregate_id,event_type,partition,offset,batch,parked_at,reason"
    assert sorted(line.split(",")[1] for line in lines[1:]) == ["c2", "c4", "c5"], listed.output
    listed = CliRunner().invoke(cli, ["project", "list", "--format", "csv"])
    assert listed.exit_code == 0 and listed.output.splitlines()[1].endswith(",3"), listed.output
    unknown = CliRunner().invoke(cli, ["project", "parked", "lucky_total"])
    assert unknown.exit_code == 1 and "no read model 'lucky_total'" in unknown.output
    # a generation by its number (a rebuild's, before readers move to it)
    listed = CliRunner().invoke(cli, ["project", "parked", "lucky_totals", "--generation", "1", "--format", "json"])
    assert listed.exit_code == 0 and sorted(json.loads(line)["aggregate_id"] for line in listed.output.splitlines()) == ["c2", "c4", "c5"]
    unknown = CliRunner().invoke(cli, ["project", "parked", "lucky_totals", "--generation", "2"])
    assert unknown.exit_code == 1 and "lucky_totals has no generation 2 (it has: 1)" in unknown.output


@pytest.mark.kafka
@pytest.mark.spark
async def test_a_read_model_that_fails_on_every_event_parks_nothing_and_fails(
    settings: Settings, spark: SparkSession, tmp_path: Path, runner_said: Callable[[], str]
) -> None:
    """A failure that is the read model's, not an event's (on every event of a kind, here)
    parks nothing: past PARKED_PER_BATCH_MAX aggregates, the batch fails, as with parking
    off, and so does the run."""

    def failing_on_every_row(events: DataFrame, writer: esk.BatchWriter) -> int:
        rows = events.select(
            F.raise_error(F.lit("the read model's own bug")).cast("string").alias("counter_id"), F.lit(0).cast("long").alias("total"), "version"
        )
        return writer.merge(rows, esk.Merge(on="t.counter_id = s.counter_id"))

    broken = esk.Projection(LUCKY.model, LUCKY.columns, failing_on_every_row)
    settings = _counters_settings(settings, tmp_path)
    async with system(settings) as s:
        for counter in [f"c{n}" for n in range(PARKED_PER_BATCH_MAX + 2)]:
            assert (await s.client.post(f"/v1/counters/{counter}/start", json={})).status_code == 200
        with pytest.raises(Exception, match="the read model's own bug"):
            await asyncio.to_thread(run, settings, broken, spark=spark)
    assert Tables(settings.projections.warehouse_dir).parked("lucky_totals", 1).load() == []
    assert ": parked " not in runner_said() and "nothing parked: the failure is the read model's code" in runner_said()
    assert "looking for the event that fails it" in runner_said()


@pytest.mark.kafka
@pytest.mark.spark
@pytest.mark.timeout(600)
async def test_a_read_model_that_fails_as_it_runs_is_left_out_of_esk_devs_driver_and_the_others_go_on(
    settings: Settings, tmp_path: Path, runner_said: Callable[[], str]
) -> None:
    """`--leave-out-invalid` (esk dev's driver): a read model whose batch fails with nothing
    to park (its code's bug) is told and left out; the others keep up. Without it, every
    read model of the driver stopped, and a restart of the same code failed the same way."""

    def failing_on_every_row(events: DataFrame, writer: esk.BatchWriter) -> int:
        rows = events.select(F.raise_error(F.lit("the read model's own bug")).cast("string").alias("counter_id"), F.lit(0).cast("long").alias("total"), "version")
        return writer.merge(rows, esk.Merge(on="t.counter_id = s.counter_id"))

    broken = esk.Projection(esk.ReadModel("broken_totals", (counters,), "fails"), LUCKY.columns, failing_on_every_row)
    settings = _counters_settings(settings, tmp_path)
    rows = ReadModelRows(settings)
    stop = StopRequest()
    async with system(settings) as s:
        for counter in [f"c{n}" for n in range(PARKED_PER_BATCH_MAX + 2)]:
            assert (await s.client.post(f"/v1/counters/{counter}/start", json={})).status_code == 200
        driver = asyncio.create_task(asyncio.to_thread(run_several, settings, [broken, LUCKY], True, False, stop, True))
        try:
            await _until(lambda: "broken_totals: failed: " in runner_said(), "the broken read model to be left out")
            assert (await s.client.post("/v1/counters/c0/add", json={"n": 4})).status_code == 200  # after it was left out
            await _until(lambda: _row(rows, "c0") == (4, 2), "the other read model to keep up")
            assert not driver.done()
        finally:
            stop.asked.set()
        with pytest.raises(RunFailed, match=r"^broken_totals failed: .*the read model's own bug"):
            await driver
    said = runner_said()
    assert "broken_totals g1 batch 0: nothing parked: the failure is the read model's code, not one aggregate's event" in said
    assert "left out of this run, the other read models going on" in said


def _row(rows: ReadModelRows, counter: str) -> tuple[int, int] | None:
    try:
        found = rows.read("lucky_totals", {"counter_id": counter}, limit=1)
    except Exception:  # not built yet
        return None
    return (found[0]["total"], found[0]["version"]) if found else None


@pytest.mark.kafka
@pytest.mark.spark
async def test_a_batch_whose_earlier_step_was_written_parks_nothing(settings: Settings, spark: SparkSession, tmp_path: Path) -> None:
    """A read model that writes in steps, the second failing on an event: the first step's
    write holds the event already, and would not be written again without it (each step is
    exactly once), so the batch fails rather than park half of it."""

    def in_two_steps(events: DataFrame, writer: esk.BatchWriter) -> int:
        counted = events.filter(esk.of(counters)).groupBy(F.col("aggregate_id").alias("counter_id")).agg(
            F.lit(0).cast("long").alias("total"), F.max("version").alias("version")
        )
        writer.merge(counted, esk.Merge(on="t.counter_id = s.counter_id", update={"version": "s.version"}), step="versions")
        return _lucky_totals(events, writer)

    settings = _counters_settings(settings, tmp_path)
    async with system(settings) as s:
        for command, body in (("start", {}), ("add", {"n": UNLUCKY})):
            assert (await s.client.post(f"/v1/counters/c1/{command}", json=body)).status_code == 200
        with pytest.raises(Exception, match="13 is not a number this read model takes"):
            await asyncio.to_thread(run, settings, esk.Projection(LUCKY.model, LUCKY.columns, in_two_steps), spark=spark)
    assert Tables(settings.projections.warehouse_dir).parked("lucky_totals", 1).load() == []


@pytest.mark.kafka
@pytest.mark.spark
async def test_events_failing_the_read_model_in_two_ways_in_one_batch_each_park_their_aggregate(
    settings: Settings, spark: SparkSession, tmp_path: Path
) -> None:
    """One batch, two events the read model fails on in two ways (a `raise_error` and a
    division by zero: Spark tells one of them as the batch's failure): both aggregates are
    parked, each with its own reason, and the others go on."""

    def picky_totals(events: DataFrame, writer: esk.BatchWriter) -> int:
        return _totals(events, writer, lambda n: F.when(n == UNLUCKY, F.raise_error(F.lit("13 is not a number this read model takes")))
                       .when(n == 7, (n / (n - 7)).cast("long")))

    settings = _counters_settings(settings, tmp_path)
    async with system(settings) as s:
        for counter, command, body in (("c1", "start", {}), ("c2", "start", {}), ("c3", "start", {}), ("c1", "add", {"n": 2}),
                                       ("c2", "add", {"n": UNLUCKY}), ("c3", "add", {"n": 7}), ("c1", "add", {"n": 3})):
            assert (await s.client.post(f"/v1/counters/{counter}/{command}", json=body)).status_code == 200
        summary = await asyncio.to_thread(run, settings, esk.Projection(LUCKY.model, LUCKY.columns, picky_totals), spark=spark)
    assert summary.caught_up
    rows = ReadModelRows(settings)
    assert {r["counter_id"]: (r["total"], r["version"]) for r in rows.read("lucky_totals", {}, limit=10)} == {
        "c1": (5, 3), "c2": (0, 1), "c3": (0, 1)
    }
    reasons = {p.aggregate_id: p.reason for p in rows.parked("lucky_totals")}
    assert sorted(reasons) == ["c2", "c3"], reasons
    assert "13 is not a number this read model takes" in reasons["c2"] and "DIVIDE_BY_ZERO" in reasons["c3"], reasons


# As PySpark 4.0 words them: a division by zero in a DataFrame's expression, a raise_error
# (no call named), a Python UDF's exception (its own frames kept, PySpark's worker's not)
DIVISION = """[DIVIDE_BY_ZERO] Division by zero. Use `try_divide` to tolerate divisor being 0 and return NULL instead. SQLSTATE: 22012
== DataFrame ==
"__truediv__" was called from
/app/read_models.py:12

"""
RAISED = "[USER_RAISED_EXCEPTION] 13 refused SQLSTATE: P0001"
IN_A_UDF = """
  An exception was thrown from the Python worker. Please see the stack trace below.
Traceback (most recent call last):
  File "/app/read_models.py", line 7, in checked
    raise ValueError("13 refused")
ValueError: 13 refused
"""


def test_a_failure_is_told_with_where_in_the_read_models_code_it_failed() -> None:
    assert _told_in_full(ArithmeticError(DIVISION)) == '\n== DataFrame ==\n"__truediv__" was called from\n/app/read_models.py:12'
    assert _told_in_full(RuntimeError(RAISED)) == ""
    assert _told_in_full(RuntimeError(IN_A_UDF)) == (
        '\nTraceback (most recent call last):\n  File "/app/read_models.py", line 7, in checked\n'
        '    raise ValueError("13 refused")\nValueError: 13 refused'
    )


def _lucky_checked(events: DataFrame, writer: esk.BatchWriter) -> int:
    """lucky_totals, 13 refused by a Python UDF of the read model's own."""

    def refuse_unlucky(n: int | None) -> int | None:
        if n == UNLUCKY:
            raise ValueError("13 is not a number this read model takes")
        return n

    return _totals(events, writer, F.udf(refuse_unlucky, "long"))


# ESK_READ_MODELS=tests.projections.test_parking:UDF_READ_MODELS
UDF_READ_MODELS = [esk.Projection(LUCKY.model, LUCKY.columns, _lucky_checked)]


@pytest.mark.kafka
@pytest.mark.spark
@pytest.mark.parametrize(
    ("read_model", "models"),
    # a UDF's Python exception before a shuffle; Spark's own (raise_error) as the rows are written
    [("lucky_totals", "UDF_READ_MODELS"), ("lucky_adds", "WRITE_STAGE_READ_MODELS")],
    ids=["fails-in-a-udf-before-a-shuffle", "fails-as-it-writes"],
)
async def test_an_operator_reads_a_batchs_failure_once_in_the_read_models_terms(
    settings: Settings, tmp_path: Path, read_model: str, models: str
) -> None:
    """`esk project run` as its own process, as an operator runs it: esk tells the batch's
    failure once, in the read model's terms (a UDF's Python traceback with it), and what it
    parked; Spark's lines about the failed tasks (a JVM stack trace twice each, of Spark's
    code alone) are not written, for the batch nor for the probes that find the event (a
    failed job each, a write aborted each when the rows fail as they are written)."""
    settings = _counters_settings(settings, tmp_path)
    async with system(settings) as s:
        for counter, command, body in (("c1", "start", {}), ("c2", "start", {}), ("c1", "add", {"n": 2}), ("c2", "add", {"n": UNLUCKY})):
            assert (await s.client.post(f"/v1/counters/{counter}/{command}", json=body)).status_code == 200
        done = await asyncio.to_thread(
            subprocess.run, [sys.executable, "-m", "esk", "project", "run", read_model],
            env=esk_env(settings, ESK_READ_MODELS=f"{__name__}:{models}"),
            cwd=tmp_path, capture_output=True, text=True, timeout=180,
        )
    assert done.returncode == 0, done.stderr
    assert f"{read_model} g1 batch 0 failed (" in done.stderr and "): looking for the event that fails it" in done.stderr
    assert "parked counters 'c2': its Added at partition" in done.stderr
    assert [line for line in done.stderr.splitlines() if line.startswith("\tat ")] == [], done.stderr
    for spark_s in ("Exception in task", "Lost task", "aborting job", "Aborting task", "Aborting commit"):
        assert spark_s not in done.stderr, done.stderr
    if models == "UDF_READ_MODELS":  # where in the read model's code
        assert ", in refuse_unlucky\n" in done.stderr and "ValueError: 13 is not a number this read model takes" in done.stderr, done.stderr


@pytest.mark.kafka
@pytest.mark.spark
async def test_old_events_are_read_as_the_processor_reads_them_and_one_whose_upcaster_fails_is_parked(
    settings: Settings, spark: SparkSession, tmp_path: Path
) -> None:
    """Events of an older release, upcast in the batch: the payload a read model sees is the
    event class's, validated (a "9" its upcaster leaves is the 9 the processor reads), and
    an event the upcaster fails on parks its aggregate, as an event the read model's own
    code fails on does."""
    settings = _counters_settings(settings, tmp_path)
    async with system(settings) as s:
        for command, body in (("start", {}), ("add", {"n": 2})):
            assert (await s.client.post(f"/v1/counters/c1/{command}", json=body)).status_code == 200

        def written(aggregate_id: str, version: int, type_name: str, data: dict[str, object], schema_version: int = 1) -> bytes:
            return json.dumps({
                "event_id": f"counters/{aggregate_id}/{version}", "aggregate_type": "counters", "aggregate_id": aggregate_id,
                "version": version, "type": type_name, "schema_version": schema_version, "data": data, "command_id": "x",
                "correlation_id": "x", "causation_id": "x", "recorded_at": 1_700_000_000_000,
            }).encode()

        producer = AIOKafkaProducer(**client_options(settings), transactional_id=f"legacy-{uuid.uuid4()}")
        await producer.start()
        try:
            async with producer.transaction():  # an older release's: Added v1 said "amount"
                for aggregate_id, data in (("old1", {"amount": "9"}), ("old2", {"quantity": 4})):  # old2's: no upcaster takes it
                    await producer.send_and_wait(events_topic(settings, "counters"), written(aggregate_id, 1, "Started", {}), key=aggregate_id.encode())
                    await producer.send_and_wait(events_topic(settings, "counters"), written(aggregate_id, 2, "Added", data), key=aggregate_id.encode())
        finally:
            await producer.stop()
        summary = await asyncio.to_thread(run, settings, LUCKY, spark=spark)
        assert summary.caught_up
        rows = ReadModelRows(settings)
        everything = {r["counter_id"]: (r["total"], r["version"]) for r in rows.read("lucky_totals", {}, limit=10)}
        assert everything == {"c1": (2, 2), "old1": (9, 2), "old2": (0, 1)}
        [parked] = rows.parked("lucky_totals")
        assert (parked.aggregate_id, parked.event_type, parked.offset > 0) == ("old2", "Added", True)
        assert "KeyError" in parked.reason and "amount" in parked.reason, parked.reason

        # Today's Added, of a number past a bigint (a Python int has no bound: a reactor may
        # send one). Spark would read it as null: its total wrong, nothing told.
        producer = AIOKafkaProducer(**client_options(settings), transactional_id=f"huge-{uuid.uuid4()}")
        await producer.start()
        try:
            async with producer.transaction():
                await producer.send_and_wait(events_topic(settings, "counters"), written("huge", 1, "Started", {}), key=b"huge")
                added = written("huge", 2, "Added", {"n": 2**70}, Added.schema_version)
                await producer.send_and_wait(events_topic(settings, "counters"), added, key=b"huge")
        finally:
            await producer.stop()
        assert (await asyncio.to_thread(run, settings, LUCKY, spark=spark)).caught_up
    everything = {r["counter_id"]: (r["total"], r["version"]) for r in rows.read("lucky_totals", {}, limit=10)}
    assert everything == {"c1": (2, 2), "old1": (9, 2), "old2": (0, 1), "huge": (0, 1)}
    _, huge = rows.parked("lucky_totals")
    assert (huge.aggregate_id, huge.event_type) == ("huge", "Added")
    assert "Malformed records" in huge.reason and "Numeric value (1180591620717411303424) out of range of long" in huge.reason, huge.reason


NEWER_ADDED = f"counters Added v{Added.schema_version + 1} (1; this code knows v{Added.schema_version})"


async def _write_newer_added(settings: Settings, aggregate_id: str, version: int) -> Position:
    """An Added of the next schema version, as a processor of the next release writes it;
    the position past it."""
    return await _write_newer(settings, aggregate_id, version, "Added", Added.schema_version + 1)


async def _write_newer(settings: Settings, aggregate_id: str, version: int, type_name: str, schema_version: int) -> Position:
    newer = {
        "event_id": f"counters/{aggregate_id}/{version}", "aggregate_type": "counters", "aggregate_id": aggregate_id,
        "version": version, "type": type_name, "schema_version": schema_version, "data": {"amount": 5},
        "command_id": "x", "correlation_id": "x", "causation_id": "x", "recorded_at": 1_700_000_000_000,
    }
    producer = AIOKafkaProducer(**client_options(settings), transactional_id=f"newer-{uuid.uuid4()}")
    await producer.start()
    try:
        async with producer.transaction():
            written = await producer.send_and_wait(events_topic(settings, "counters"), json.dumps(newer).encode(), key=aggregate_id.encode())
    finally:
        await producer.stop()
    return Position(written.topic, written.partition, written.offset + 1)


async def _until(holds: Callable[[], bool], what: str, timeout_s: float = 300) -> None:
    for _ in range(int(timeout_s / 0.5)):
        if holds():
            return
        await asyncio.sleep(0.5)
    raise AssertionError(f"not in {timeout_s}s: {what}")


@pytest.mark.kafka
@pytest.mark.spark
async def test_events_newer_than_the_read_models_code_are_not_written_until_code_that_knows_them_runs(
    settings: Settings, spark: SparkSession, tmp_path: Path, runner_said: Callable[[], str]
) -> None:
    """A processor released before the read models writes Added v3 (say, `n` renamed): this
    code would read its `n` as null and add nothing, for good (a trial's staged release left
    wrong totals no rebuild was asked for). Its batch is not written: a one-shot run fails in
    a line, a continuous one waits for a stop (the next start, with new code, takes it)."""
    settings = _counters_settings(settings, tmp_path)
    async with system(settings) as s:
        for command, body in (("start", {}), ("add", {"n": 2})):
            assert (await s.client.post(f"/v1/counters/c1/{command}", json=body)).status_code == 200
        await _write_newer_added(settings, "c1", 3)

    told = f"batch 0 holds events newer than this code knows (a schema version, or a type): {NEWER_ADDED}"
    with pytest.raises(EventsNewerThanCode, match=re.escape(told)):
        await asyncio.to_thread(run, settings, LUCKY, spark=spark)
    # Spark's logger of a query's failure, off while this one failed on purpose, is on again
    log4j = spark.sparkContext._jvm.org.apache.logging.log4j  # type: ignore[union-attr]
    assert str(log4j.LogManager.getLogger(QUERY_FAILURE_LOGGER).getLevel()) != "OFF"
    tables = Tables(settings.projections.warehouse_dir)
    assert tables.current_generation("lucky_totals") is None  # c1's first two events neither: they share the batch

    stop, turn = StopRequest(), threading.Lock()
    continuous = asyncio.create_task(asyncio.to_thread(run, settings, LUCKY, True, spark=spark, stop=stop, catch_up_turn=turn))
    try:
        await _until(lambda: "it stands still until it runs with the code that knows them" in runner_said(), "it stands still")
        assert told in runner_said()
        assert turn.acquire(blocking=False), "it stands still holding the catch-up turn: the driver's other read models would wait"
        turn.release()
    finally:
        stop.asked.set()  # a run that stands still ends only so
    summary = await asyncio.wait_for(continuous, 120)
    assert summary.batches == 0 and not summary.caught_up
    assert tables.current_generation("lucky_totals") is None


@pytest.mark.kafka
@pytest.mark.spark
async def test_an_operator_reads_a_run_held_up_by_newer_events_in_a_line(settings: Settings, tmp_path: Path) -> None:
    """`esk project run` as its own process: events newer than its code end it in a line,
    a situation to act on (release the read models with the domain), not Spark's ERROR
    that the query failed, with its traces."""
    settings = _counters_settings(settings, tmp_path)
    async with system(settings) as s:
        for command, body in (("start", {}), ("add", {"n": 2})):
            assert (await s.client.post(f"/v1/counters/c1/{command}", json=body)).status_code == 200
        await _write_newer_added(settings, "c1", 3)
    done = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "esk", "project", "run", "lucky_totals"],
        env=esk_env(settings), cwd=tmp_path, capture_output=True, text=True, timeout=180,
    )
    assert done.returncode == 1, done.stderr
    assert "holds events newer than this code knows" in done.stderr.splitlines()[-1], done.stderr
    assert "terminated with error" not in done.stderr and "Traceback" not in done.stderr, done.stderr


@pytest.mark.kafka
@pytest.mark.spark
async def test_an_event_type_the_read_models_code_does_not_know_is_not_left_out_unsaid(
    settings: Settings, spark: SparkSession, tmp_path: Path
) -> None:
    """The next release adds an event type (say, `Doubled`): this code's read model would
    leave its rows out, and the next code would not see them again (no rebuild asked for)."""
    settings = _counters_settings(settings, tmp_path)
    async with system(settings) as s:
        assert (await s.client.post("/v1/counters/c1/start", json={})).status_code == 200
        await _write_newer(settings, "c1", 2, "Doubled", 1)
    told = "batch 0 holds events newer than this code knows (a schema version, or a type): counters Doubled v1 (1; this code knows no such type)"
    with pytest.raises(EventsNewerThanCode, match=re.escape(told)):
        await asyncio.to_thread(run, settings, LUCKY, spark=spark)
    assert Tables(settings.projections.warehouse_dir).current_generation("lucky_totals") is None


@pytest.mark.kafka
@pytest.mark.spark
async def test_a_continuous_run_that_meets_newer_events_after_its_catch_up_stands_still_with_what_came_before(
    settings: Settings, spark: SparkSession, tmp_path: Path, runner_said: Callable[[], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = _counters_settings(settings, tmp_path)
    rows = ReadModelRows(settings)

    def totals() -> dict[str, tuple[int, int]]:
        try:
            return {r["counter_id"]: (r["total"], r["version"]) for r in rows.read("lucky_totals", {}, limit=10)}
        except ReadModelNotBuilt:
            return {}

    async with system(settings) as s:
        for command, body in (("start", {}), ("add", {"n": 2})):
            assert (await s.client.post(f"/v1/counters/c1/{command}", json=body)).status_code == 200
        stop = StopRequest()
        continuous = asyncio.create_task(asyncio.to_thread(run, settings, LUCKY, True, spark=spark, stop=stop))
        try:
            await _until(lambda: totals() == {"c1": (2, 2)}, "c1 kept up")
            past = await _write_newer_added(settings, "c1", 3)
            await _until(lambda: "it stands still until it runs with the code that knows them" in runner_said(), "it stands still")
            assert NEWER_ADDED in runner_said()
            # a read that waits for it is told why it will not come, and not to retry
            r = await s.client.get("/v1/projections/lucky_totals", params={"after": past.token(), "wait_ms": 100})
            assert r.status_code == 503 and r.json()["code"] == "not_caught_up", r.text
            assert "the run keeping it is held up: " in r.json()["detail"] and NEWER_ADDED in r.json()["detail"], r.text
            assert "retry-after" not in r.headers
            for variable, value in esk_env(settings).items():
                monkeypatch.setenv(variable, value)
            listed = CliRunner().invoke(cli, ["project", "list", "--format", "json"])
            [kept_by] = [row["kept_by"] for row in map(json.loads, listed.output.splitlines()) if row["name"] == "lucky_totals"]
            assert len(kept_by) == 1 and " (held up: lucky_totals g1 batch " in kept_by[0] and NEWER_ADDED in kept_by[0], kept_by
        finally:
            stop.asked.set()
        summary = await asyncio.wait_for(continuous, 120)
    assert totals() == {"c1": (2, 2)}  # not (2, 3): the v3 event's amount read as nothing
    assert summary.held_up and summary.lag == {}  # not its last batch's "lag 0": the batch refused is behind
    assert summary.caught_up  # its catch-up was


@pytest.mark.kafka
@pytest.mark.spark
async def test_a_stop_while_a_batch_is_probed_for_its_failing_event_stops_the_run(
    settings: Settings, spark: SparkSession, tmp_path: Path
) -> None:
    """SIGTERM as the batch's events are probed: the probe stops at once, before the query is
    stopped, and Spark took that for the batch's failure: the run failed (exit 1, traces),
    where a stop ends it between batches. The next start parks the event and goes on."""
    settings = _counters_settings(settings, tmp_path)
    stop = StopRequest()

    def stopped_as_probed(events: DataFrame, writer: esk.BatchWriter) -> int:
        if isinstance(writer, Probe):
            stop.asked.set()
        return _lucky_totals(events, writer)

    stopping = esk.Projection(LUCKY.model, LUCKY.columns, stopped_as_probed)
    async with system(settings) as s:
        for counter, command, body in (("c1", "start", {}), ("c2", "start", {}), ("c1", "add", {"n": 2}), ("c2", "add", {"n": UNLUCKY})):
            assert (await s.client.post(f"/v1/counters/{counter}/{command}", json=body)).status_code == 200
    summary = await asyncio.to_thread(run, settings, stopping, spark=spark, stop=stop)
    assert stop.asked.is_set() and not summary.caught_up and summary.batches == 0
    summary = await asyncio.to_thread(run, settings, LUCKY, spark=spark)
    assert summary.caught_up and [p.aggregate_id for p in Tables(settings.projections.warehouse_dir).parked("lucky_totals", 1).load()] == ["c2"]


@pytest.mark.kafka
@pytest.mark.spark
async def test_a_run_stopped_as_it_refuses_newer_events_says_it_was_held_up(
    settings: Settings, spark: SparkSession, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stop that a continuous run sees while its batch is being refused for newer events:
    the run ends held up, as told, and Spark's logger of the query's failure is on again for
    the driver's other runs. The refused batch's failure came out of the run as Spark's
    StreamingQueryException (a hundred lines), and the logger stayed off."""
    settings = _counters_settings(settings, tmp_path)
    stop = StopRequest()

    def off_then_stopped(spark: SparkSession, names: tuple[str, ...]) -> Callable[[], None]:
        turn_on = loggers_off(spark, names)
        stop.asked.set()  # an operator's Ctrl-C, say, that the run sees before its query's failure
        time.sleep(runner.POLL_S * 2)
        return turn_on

    monkeypatch.setattr(runner, "loggers_off", off_then_stopped)
    tables = Tables(settings.projections.warehouse_dir)
    async with system(settings) as s:
        for command, body in (("start", {}), ("add", {"n": 2})):
            assert (await s.client.post(f"/v1/counters/c1/{command}", json=body)).status_code == 200
        continuous = asyncio.create_task(asyncio.to_thread(run, settings, LUCKY, True, spark=spark, stop=stop))
        try:
            await _until(lambda: tables.current_generation("lucky_totals") is not None, "caught up")
            await _write_newer_added(settings, "c1", 3)
            summary = await asyncio.wait_for(continuous, 120)
        finally:
            stop.asked.set()
    assert summary.held_up and not summary.lag
    log4j = spark.sparkContext._jvm.org.apache.logging.log4j  # type: ignore[union-attr]
    assert str(log4j.LogManager.getLogger(QUERY_FAILURE_LOGGER).getLevel()) != "OFF"
