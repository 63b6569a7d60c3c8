"""A read model's mistakes are told when its run starts, in a line naming it, before any
event comes: what it reads must be in the domain, and its `apply` is planned over no events
with a writer that writes nothing (runner._check_plan, catalog.PlanCheck). Spark, no Kafka."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

pytest.importorskip("pyspark")

from pyspark.errors import AnalysisException
from pyspark.sql import DataFrame
from pyspark.sql import functions as F

import esk
from domain.accounts import Deposited, accounts
from esk.projections.runner import ReadModelInvalid, RunFailed, _check_plan, _check_reads
from esk.settings import Settings
from projections.read_models import READ_MODELS
from tests.counters import Added, counters

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

COLUMNS = "counter_id STRING, total BIGINT, version BIGINT"
MERGE = esk.Merge(
    on="t.counter_id = s.counter_id",
    update={"total": "t.total + s.n", "version": "s.version"},
    insert={"counter_id": "s.counter_id", "total": "s.n", "version": "s.version"},
)


def _counter_rows(events: DataFrame) -> DataFrame:
    return events.filter(esk.of(counters)).select(
        F.col("aggregate_id").alias("counter_id"), esk.payload(counters, Added)["n"].alias("n"), "version"
    )


def _projection(apply: Callable[[DataFrame, esk.BatchWriter], int], columns: str = COLUMNS) -> esk.Projection:
    return esk.Projection(esk.ReadModel("counter_totals", (counters,), "totals"), columns, apply)


def _check(spark: SparkSession, tmp_path: Path, projection: esk.Projection) -> None:
    schema = spark.createDataFrame([], projection.columns).schema
    _check_plan(spark, projection, "esk.test.check", tmp_path / "never-written", schema)


def test_the_example_read_models_and_a_right_one_plan_without_writing(spark: SparkSession, tmp_path: Path) -> None:
    for projection in [*READ_MODELS, _projection(lambda events, writer: writer.merge(_counter_rows(events), MERGE))]:
        _check(spark, tmp_path, projection)
    assert not (tmp_path / "never-written").exists()


@pytest.mark.parametrize(
    ("apply", "error"),
    [
        (
            lambda events, writer: writer.merge(_counter_rows(events), esk.Merge(on="t.counter_id = s.counter_id", update={"totl": "s.n"})),
            "its apply fails on a batch: its Merge sets totl, which its table does not have (its columns: counter_id, total, version)",
        ),
        (
            lambda events, writer: writer.merge(_counter_rows(events), esk.Merge(on="t.counter_id = s.counter_id", update={"total": "s.amount"})),
            "its apply fails on a batch: [UNRESOLVED_COLUMN.WITH_SUGGESTION] A column, variable, or function parameter with name `s`.`amount` cannot be resolved.",
        ),
        (
            lambda events, writer: writer.merge(events.select(F.col("aggregate_id").alias("counter_id"), "amount"), MERGE),
            "its apply fails on a batch: [UNRESOLVED_COLUMN.WITH_SUGGESTION] A column, variable, or function parameter with name `amount` cannot be resolved.",
        ),
        (
            lambda events, writer: writer.append(_counter_rows(events)),
            "its apply fails on a batch: it appends n, which its table does not have (its columns: counter_id, total, version)",
        ),
        (
            lambda events, writer: writer.merge(events.select(esk.payload(counters, Deposited)), MERGE),
            "its apply fails on a batch: Deposited is not an event of counters",
        ),
        (
            lambda events, writer: writer.merge(events.filter(esk.of(accounts)), MERGE),
            "its apply fails on a batch: counter_totals reads counters, not accounts: its batches hold none of accounts's events "
            "(add accounts to its ReadModel's reads)",
        ),
        (
            lambda events, writer: writer.merge(writer.lookup(_counter_rows(events), "counter"), MERGE),
            "its apply fails on a batch: [UNRESOLVED_COLUMN.WITH_SUGGESTION] A column, variable, or function parameter with name `counter` cannot be resolved.",
        ),
    ],
    ids=["a column it does not have", "a batch column a Merge names", "a column events do not have", "an append of other columns",
         "an event of another type", "a type it does not read", "a lookup on a column the batch does not have"],
)
def test_a_mistake_in_apply_is_told_in_a_line(spark: SparkSession, tmp_path: Path, apply: Callable[[DataFrame, esk.BatchWriter], int], error: str) -> None:
    with pytest.raises(ReadModelInvalid) as refused:
        _check(spark, tmp_path, _projection(apply))
    assert str(refused.value).startswith(error), str(refused.value)
    assert "\n" not in str(refused.value)
    assert str(RunFailed("counter_totals", refused.value)).startswith(f"counter_totals: {error}")


def test_a_read_model_of_a_type_the_domain_does_not_register_is_refused() -> None:
    settings = Settings(_env_file=None).model_copy(update={"domain": "tests.counters:AGGREGATES"})
    _check_reads(settings, _projection(lambda events, writer: 0))
    reads_accounts = esk.Projection(esk.ReadModel("balances", (accounts,), "balances"), COLUMNS, lambda events, writer: 0)
    with pytest.raises(ReadModelInvalid, match=r"^it reads accounts, which ESK_DOMAIN=tests.counters:AGGREGATES does not register: "
                       r"register it there, or take it out of the ReadModel's reads$"):
        _check_reads(settings, reads_accounts)


def test_what_the_check_cannot_plan_is_left_to_the_batches_and_spark_errors_stay_spark_errors(spark: SparkSession, tmp_path: Path) -> None:
    written: list[str] = []

    def own_write(events: DataFrame, writer: esk.BatchWriter) -> int:
        return writer.run("own", lambda: written.append("written") or 0)

    def wants_rows(events: DataFrame, writer: esk.BatchWriter) -> int:
        first = events.first()
        return writer.merge(_counter_rows(events).limit(first["version"]), MERGE)  # type: ignore[index]

    for apply in (own_write, wants_rows):
        _check(spark, tmp_path, _projection(apply))
    assert written == []  # a write of its own ends the check, unmade
    assert not (tmp_path / "never-written").exists()
    # the check's quiet did not break PySpark's own logging of the next analysis error
    with pytest.raises(ReadModelInvalid):
        _check(spark, tmp_path, _projection(lambda events, writer: writer.merge(events.select("nope"), MERGE)))
    with pytest.raises(AnalysisException, match="nope"):
        spark.range(1).select("nope")
