"""BatchWriter.lookup on the Spark path (a big batch into a table with rows): the same rows
whichever join it plans, and the keys broadcast only for a batch of at most
BROADCAST_KEYS_MAX events, as a broadcast of more could exceed what the driver holds."""

from __future__ import annotations

from pathlib import Path

import pytest

pyspark = pytest.importorskip("pyspark")

from pyspark.sql import DataFrame, SparkSession  # noqa: E402

from esk.projections.catalog import BROADCAST_KEYS_MAX, BatchWriter, session_conf  # noqa: E402

pytestmark = pytest.mark.spark

COLUMNS = "customer_id STRING, order_id STRING, total BIGINT"


def lookup(spark: SparkSession, path: Path, events: int) -> DataFrame:
    writer = BatchWriter(spark, "esk.app.model.g1", 0, str(path), on_driver=False, events=events)
    keys = spark.createDataFrame([("a", 1), ("c", 2), ("x", 3)], "customer_id STRING, n INT")
    return writer.lookup(keys, "customer_id")


def test_a_big_batch_looks_up_the_same_rows_by_broadcast_or_by_shuffle(spark: SparkSession, tmp_path: Path) -> None:
    path = tmp_path / "table"
    rows = [("a", "1", 10), ("b", "2", 20), ("a", "3", 30), ("c", "4", 40)]
    spark.createDataFrame(rows, COLUMNS).write.format("delta").save(str(path))

    # As in a streaming query's batch, where the keys' size is not known when the join is
    # planned: Spark broadcasts nothing of its own accord, only what the lookup hints.
    with session_conf(spark, {"spark.sql.autoBroadcastJoinThreshold": "-1"}):
        small, big = lookup(spark, path, BROADCAST_KEYS_MAX), lookup(spark, path, BROADCAST_KEYS_MAX + 1)
        expected = [("a", "1", 10), ("a", "3", 30), ("c", "4", 40)]
        for found in (small, big):
            assert found.columns == ["customer_id", "order_id", "total"]
            assert sorted(tuple(r) for r in found.collect()) == expected
        assert "BroadcastHashJoin" in plan(small)
        assert "BroadcastHashJoin" not in plan(big) and "SortMergeJoin" in plan(big)


def plan(frame: DataFrame) -> str:
    return str(frame._jdf.queryExecution().executedPlan().toString())
