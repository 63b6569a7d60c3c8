"""A batch's writes and filters as Spark runs them in the streaming query's own session: a
write of the read model's own through `writer.run` is idempotent as esk's are, and the
versions guard is not merged with the read model's filters (found by a review)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("pyspark")

from deltalake import DeltaTable
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

import esk
from esk.projections.runner import run
from esk.settings import Settings
from tests.counters import Added, counters
from tests.projections.settings import counters_settings
from tests.system import system

CRASH_AFTER_OWN_WRITE: list[bool] = []  # set: the batch fails right after its own write
SIDE: list[str] = []  # the side table's path, the test's


def _with_a_side_table(events: DataFrame, writer: esk.BatchWriter) -> int:
    """Counts the additions, and appends each to a side table of its own (writer.run)."""
    adds = events.filter(esk.is_event(counters, Added)).select("event_id", esk.payload(counters, Added)["n"].alias("n"))
    written = writer.run("own", lambda: adds.write.format("delta").mode("append").save(SIDE[0]) or 0)
    if CRASH_AFTER_OWN_WRITE and not writer.planning:
        raise RuntimeError("a crash after its own write, before the batch's offsets are committed")
    rows = adds.groupBy(F.lit("all").alias("k")).agg(F.count("*").alias("n"))
    return writer.merge(rows, esk.Merge(on="t.k = s.k", update={"n": "t.n + s.n"})) + written


def _added_totals(events: DataFrame, writer: esk.BatchWriter) -> int:
    """One event type's rows, filtered as users write it: the counters' Added is v2, Started v1."""
    adds = events.filter(esk.is_event(counters, Added)).select(
        F.col("aggregate_id").alias("counter_id"), esk.payload(counters, Added)["n"].alias("n")
    )
    rows = adds.groupBy("counter_id").agg(F.sum("n").alias("total"))
    return writer.merge(rows, esk.Merge(on="t.counter_id = s.counter_id", update={"total": "t.total + s.total"}))


READ_MODELS = [
    esk.Projection(esk.ReadModel("own_writes", (counters,), "additions counted, and kept aside"), "k STRING, n BIGINT", _with_a_side_table),
    esk.Projection(esk.ReadModel("added_totals", (counters,), "the sum of additions"), "counter_id STRING, total BIGINT", _added_totals),
]


async def _two_counters(settings: Settings) -> None:
    async with system(settings) as s:
        for counter, command, body in (("c1", "start", {}), ("c2", "start", {}), ("c1", "add", {"n": 1}), ("c1", "add", {"n": 2}), ("c2", "add", {"n": 3})):
            assert (await s.client.post(f"/v1/counters/{counter}/{command}", json=body)).status_code == 200


@pytest.mark.kafka
@pytest.mark.spark
async def test_a_write_of_its_own_through_writer_run_is_not_written_twice_when_its_batch_runs_again(
    settings: Settings, spark: SparkSession, tmp_path: Path
) -> None:
    """The batch's transaction was set on the run's session, and the batch's rows are written
    from the query's: the side table held every addition twice after a crash."""
    settings = counters_settings(settings, tmp_path, f"{__name__}:READ_MODELS", driver_write_max_events=0)
    await _two_counters(settings)
    SIDE[:] = [str(tmp_path / "side")]
    CRASH_AFTER_OWN_WRITE[:] = [True]
    try:
        with pytest.raises(Exception, match="a crash after its own write"):
            run(settings, READ_MODELS[0], spark=spark)
    finally:
        CRASH_AFTER_OWN_WRITE.clear()
    assert DeltaTable(SIDE[0]).to_pyarrow_table().num_rows == 3  # written before the crash
    summary = run(settings, READ_MODELS[0], spark=spark)  # batch 0 again
    assert summary.caught_up and summary.batches == 1
    assert sorted(DeltaTable(SIDE[0]).to_pyarrow_table()["n"].to_pylist()) == [1, 2, 3]


@pytest.mark.kafka
@pytest.mark.spark
async def test_a_batch_of_the_code_s_own_versions_is_applied_once_whatever_the_read_model_filters(
    settings: Settings, spark: SparkSession, tmp_path: Path, runner_said: Callable[[], str]
) -> None:
    """Merged with `filter(is_event(counters, Added))`, the guard read every event as an Added
    and tripped on Started v1: the batch was applied again, counted first, and so was every
    later batch of the run, the log saying it held events of another version."""
    settings = counters_settings(settings, tmp_path, f"{__name__}:READ_MODELS")
    await _two_counters(settings)
    summary = run(settings, READ_MODELS[1], spark=spark)
    assert summary.caught_up and summary.events == 5
    assert "another schema version" not in runner_said()
    rows = spark.read.format("delta").load(str(tmp_path / "warehouse" / "added_totals" / "g1")).collect()
    assert {r["counter_id"]: r["total"] for r in rows} == {"c1": 3, "c2": 3}
