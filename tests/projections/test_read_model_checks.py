"""A read model's mistakes are told when its run starts, in a line naming it, before any
event comes: what it reads must be in the domain, and its `apply` is planned over no events
with a writer that writes nothing (runner._check_plan, catalog.PlanCheck). Spark, no Kafka."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

pytest.importorskip("pyspark")

from pyspark.errors import AnalysisException
from pyspark.sql import DataFrame
from pyspark.sql import functions as F

import esk
from domain.accounts import Deposited, accounts
from esk.broker.ports import free_port
from esk.projections import catalog, runner
from esk.projections.catalog import ReadModelMistake, Tables
from esk.projections.run_lock import Keeper
from esk.projections.runner import STALL_CHECK_S, ReadModelInvalid, RunFailed, _check_plan, _check_reads, _kafka_cause
from esk.settings import Settings
from projections.read_models import READ_MODELS
from tests.counters import Added, counters
from tests.system import esk_env

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


def _check(spark: SparkSession, tmp_path: Path, projection: esk.Projection) -> str | None:
    schema = spark.createDataFrame([], projection.columns).schema
    return _check_plan(spark, projection, "esk.test.check", tmp_path / "never-written", schema)


def test_the_plan_check_notes_the_writes_a_change_of_a_merge_is_seen_and_its_layout_is_not(spark: SparkSession, tmp_path: Path) -> None:
    def merging(spec: esk.Merge) -> esk.Projection:
        return _projection(lambda events, writer: writer.merge(_counter_rows(events), spec))

    noted = _check(spark, tmp_path, merging(MERGE))
    assert noted is not None
    laid_out = esk.Merge(
        on="t.counter_id  =  s.counter_id",
        update={"version": "s.version", "total": "t.total +\n s.n"},
        insert={"version": "s.version", "counter_id": "s.counter_id", "total": "s.n"},
    )
    assert _check(spark, tmp_path, merging(laid_out)) == noted
    doubled = esk.Merge(on=MERGE.on, update={**MERGE.update, "total": "t.total + 2 * s.n"}, insert=MERGE.insert)
    assert _check(spark, tmp_path, merging(doubled)) != noted
    conditional = esk.Merge(on=MERGE.on, update=MERGE.update, insert=MERGE.insert, update_if="s.version > t.version")
    assert _check(spark, tmp_path, merging(conditional)) != noted
    appended = _projection(lambda events, writer: writer.append(_counter_rows(events).withColumnRenamed("n", "total")))
    assert _check(spark, tmp_path, appended) not in (None, noted)

    def wants_rows(events: DataFrame, writer: esk.BatchWriter) -> int:
        raise IndexError("no first row")

    assert _check(spark, tmp_path, _projection(wants_rows)) is None  # not known: nothing is compared


def test_a_table_built_before_writes_were_noted_is_given_them(spark: SparkSession, tmp_path: Path) -> None:
    from deltalake import DeltaTable

    projection = _projection(lambda events, writer: writer.merge(_counter_rows(events), MERGE))
    schema = spark.createDataFrame([], projection.columns).schema
    path = tmp_path / "g1"

    def kept() -> None:
        pytest.fail("a table readers use was started over")

    runner._create_table(spark, path, kept, schema, projection.model, False)
    assert runner.WRITES_PROPERTY not in DeltaTable(str(path)).metadata().configuration
    runner._create_table(spark, path, kept, schema, projection.model, True, "abcd")
    assert DeltaTable(str(path)).metadata().configuration[runner.WRITES_PROPERTY] == "abcd"
    with pytest.raises(ReadModelInvalid, match="its writes are not those its table"):
        runner._create_table(spark, path, kept, schema, projection.model, True, "dcba")


def test_the_example_read_models_and_a_right_one_plan_without_writing(spark: SparkSession, tmp_path: Path) -> None:
    widened = lambda events, writer: writer.append(  # noqa: E731
        events.select(F.col("aggregate_id").alias("counter_id"), F.lit(1).cast("int").alias("total"), F.lit(None).alias("version"))
    )
    # a date for a timestamp column, and a text of a number column's name the Merge does not write
    kinds = esk.Merge(on=MERGE.on, update={**MERGE.update, "at": "s.at"}, insert={**(MERGE.insert or {}), "at": "s.at"})
    of_kinds = _projection(
        lambda events, writer: writer.merge(_counter_rows(events).select("*", F.current_date().alias("at"), F.lit("x").alias("total")), kinds),
        COLUMNS + ", at TIMESTAMP",
    )
    merged = _projection(lambda events, writer: writer.merge(_counter_rows(events), MERGE))
    for projection in [*READ_MODELS, merged, _projection(widened), of_kinds]:
        _check(spark, tmp_path, projection)
    assert not (tmp_path / "never-written").exists()


def _merged_without_a_return(events: DataFrame, writer: esk.BatchWriter) -> None:
    writer.merge(_counter_rows(events), MERGE)


@pytest.mark.parametrize(
    ("apply", "error"),
    [
        (
            lambda events, writer: writer.merge(
                _counter_rows(events), esk.Merge(on="t.counter_id = s.counter_id", update={"totl": "s.n"}, insert={"totl": "s.n"})
            ),
            "its apply, planned over no events at the run's start, fails: its Merge sets totl, which its table does not have (its columns: counter_id, total, version)",
        ),
        (
            lambda events, writer: writer.merge(_counter_rows(events), esk.Merge(on="t.counter_id = s.counter_id", update={"total": "s.amount"})),
            "its apply, planned over no events at the run's start, fails: [UNRESOLVED_COLUMN.WITH_SUGGESTION] A column, variable, or function parameter with name `s`.`amount` cannot be resolved.",
        ),
        (
            lambda events, writer: writer.merge(events.select(F.col("aggregate_id").alias("counter_id"), "amount"), MERGE),
            "its apply, planned over no events at the run's start, fails: [UNRESOLVED_COLUMN.WITH_SUGGESTION] A column, variable, or function parameter with name `amount` cannot be resolved.",
        ),
        (
            lambda events, writer: writer.append(_counter_rows(events)),
            "its apply, planned over no events at the run's start, fails: it appends n, which its table does not have (its columns: counter_id, total, version)",
        ),
        (
            lambda events, writer: writer.append(
                events.select(F.col("aggregate_id").alias("counter_id"), F.col("aggregate_id").alias("total"), (F.col("version") / 2).alias("version"))
            ),
            "its apply, planned over no events at the run's start, fails: it appends total as string into its bigint column, version as double "
            "into its bigint column: cast them in its code (`.cast(...)`) to append them as the table holds them",
        ),
        (
            # delta-rs's MERGE (a small batch's) refuses `t.total + s.total` for a string, Spark's casts it
            lambda events, writer: writer.merge(
                events.select(F.col("aggregate_id").alias("counter_id"), F.lit("1").alias("total"), "version"),
                esk.Merge(on="t.counter_id = s.counter_id", update={"total": "t.total + s.total", "version": "s.version"}),
            ),
            "its apply, planned over no events at the run's start, fails: its Merge's rows hold total as string for its bigint column: "
            "cast them in its code (`.cast(...)`) as the table holds them",
        ),
        (
            # Spark reads `if(...)`, delta-rs (a small batch's MERGE) has no such function
            lambda events, writer: writer.merge(
                _counter_rows(events),
                dataclasses.replace(MERGE, update={"total": "if(s.n > 0, t.total + s.n, t.total)", "version": "s.version"}),
            ),
            "its apply, planned over no events at the run's start, fails: its Merge is one delta-rs, a small batch's writer, "
            "cannot run: Error during planning: Invalid function 'if'",
        ),
        (
            lambda events, writer: writer.merge(events.select(esk.payload(counters, Deposited)), MERGE),
            "its apply, planned over no events at the run's start, fails: Deposited is not an event of counters",
        ),
        (
            lambda events, writer: writer.merge(events.filter(esk.of(accounts)), MERGE),
            "its apply, planned over no events at the run's start, fails: counter_totals reads counters, not accounts: its batches hold none of accounts's events "
            "(add accounts to its ReadModel's reads)",
        ),
        (
            lambda events, writer: writer.merge(writer.lookup(_counter_rows(events), "counter"), MERGE),
            "its apply, planned over no events at the run's start, fails: [UNRESOLVED_COLUMN.WITH_SUGGESTION] A column, variable, or function parameter with name `counter` cannot be resolved.",
        ),
        (
            # its first batch with events failed, and with it every read model of the driver
            _merged_without_a_return,
            "its apply, planned over no events at the run's start, fails: counter_totals's apply returned NoneType, not the rows it wrote: "
            "return what its writer's merge or append returns",
        ),
    ],
    ids=["a column it does not have", "a batch column a Merge names", "a column events do not have", "an append of other columns",
         "an append of other types", "a merge of another kind", "a function only Spark has",
         "an event of another type", "a type it does not read", "a lookup on a column the batch does not have", "a return left out"],
)
def test_a_mistake_in_apply_is_told_in_a_line(spark: SparkSession, tmp_path: Path, apply: Callable[[DataFrame, esk.BatchWriter], int], error: str) -> None:
    with pytest.raises(ReadModelInvalid) as refused:
        _check(spark, tmp_path, _projection(apply))
    assert str(refused.value).startswith(error), str(refused.value)
    assert "\n" not in str(refused.value)
    assert str(RunFailed("counter_totals", refused.value)).startswith(f"counter_totals: {error}")


@pytest.mark.parametrize(
    ("columns", "model", "error"),
    [
        ("counter_id STRING, total BIGNT", {}, "its columns 'counter_id STRING, total BIGNT' do not parse: [UNSUPPORTED_DATATYPE]"),
        (COLUMNS, {"order_by": ("counterid",)}, "its order_by names counterid, which its columns (counter_id, total, version) do not have"),
        (COLUMNS, {"partition_by": ("totl",)}, "its partition_by names totl, which its columns (counter_id, total, version) do not have"),
    ],
    ids=["a type misspelt", "an order by a column it does not have", "a partitioning by one"],
)
def test_a_mistake_in_the_declared_table_is_told_in_a_line(spark: SparkSession, columns: str, model: dict[str, Any], error: str) -> None:
    """Before any run: a driver that leaves out what cannot run leaves these out too (they
    stopped every read model of esk dev's driver), and a read of the API would otherwise
    be a 503 naming neither the read model nor its setting."""
    projection = esk.Projection(esk.ReadModel("counter_totals", (counters,), "totals", **model), columns, lambda events, writer: 0)
    with pytest.raises(ReadModelInvalid) as refused:
        runner._table_schema(spark, projection)
    assert str(refused.value).startswith(error) and "\n" not in str(refused.value), str(refused.value)


def test_a_read_model_of_a_type_the_domain_does_not_register_is_refused() -> None:
    settings = Settings(_env_file=None).model_copy(update={"domain": "tests.counters:AGGREGATES"})
    _check_reads(settings, _projection(lambda events, writer: 0))
    reads_accounts = esk.Projection(esk.ReadModel("balances", (accounts,), "balances"), COLUMNS, lambda events, writer: 0)
    with pytest.raises(ReadModelInvalid, match=r"^it reads accounts, which ESK_DOMAIN=tests.counters:AGGREGATES does not register: "
                       r"register it there, or take it out of the ReadModel's reads$"):
        _check_reads(settings, reads_accounts)


def test_a_read_model_left_out_lets_go_of_its_generation(spark: SparkSession, tmp_path: Path) -> None:
    """`--leave-out-invalid` (esk dev's driver): a run refused at its start lets go of the
    generation it was given, so that a run of the fixed code beside the driver is not
    refused as busy for as long as the driver lives."""
    settings = Settings(_env_file=None).model_copy(
        update={
            "domain": "tests.counters:AGGREGATES",
            "projections": Settings(_env_file=None).projections.model_copy(update={"warehouse_dir": tmp_path / "warehouse"}),
        }
    )
    reads_accounts = esk.Projection(esk.ReadModel("balances", (accounts,), "balances"), COLUMNS, lambda events, writer: 0)
    with pytest.raises(RunFailed, match=r"^balances: it reads accounts, which ESK_DOMAIN=tests.counters:AGGREGATES does not register"):
        runner.run_several(settings, [reads_accounts], leave_out_invalid=True)
    lock = Tables(settings.projections.warehouse_dir).run_lock("balances", 1)
    lock.acquire()  # GenerationBusy while the driver would hold it
    lock.release()


def test_a_read_model_left_out_is_said_to_be_while_the_driver_runs(
    spark: SparkSession, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Readers and `esk project list` see why (Tables.keepers), not only that no run keeps
    it, for as long as the driver that left it out runs the others; not after."""
    settings = Settings(_env_file=None).model_copy(
        update={
            "domain": "tests.counters:AGGREGATES",
            "projections": Settings(_env_file=None).projections.model_copy(update={"warehouse_dir": tmp_path / "warehouse"}),
        }
    )
    tables = Tables(settings.projections.warehouse_dir)
    reads_accounts = esk.Projection(esk.ReadModel("balances", (accounts,), "balances"), COLUMNS, lambda events, writer: 0)
    seen: list[Keeper | None] = []
    real_run = runner.run

    def run(settings: Settings, projection: esk.Projection, *args: Any) -> runner.RunSummary:
        if projection is reads_accounts:
            return real_run(settings, projection, *args)
        # the other read model, running on: what its run's time shows of the one left out
        deadline = time.monotonic() + 60
        while tables.keepers("balances").left_out is None and time.monotonic() < deadline:
            time.sleep(0.05)
        seen.append(tables.keepers("balances").left_out)
        return runner.RunSummary(projection.model.name, 1)

    monkeypatch.setattr(runner, "run", run)
    with pytest.raises(RunFailed, match=r"^balances: it reads accounts"):
        runner.run_several(settings, [reads_accounts, _projection(lambda events, writer: 0)], leave_out_invalid=True)
    [left_out] = seen
    assert left_out is not None and left_out.who.startswith(f"pid {os.getpid()} on ")
    assert left_out.held_up == (
        "it reads accounts, which ESK_DOMAIN=tests.counters:AGGREGATES does not register: register it there, or take it out "
        "of the ReadModel's reads"
    )
    assert tables.keepers("balances").left_out is None  # gone with the driver's run


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


def test_a_one_shot_run_without_a_broker_is_told_at_once(tmp_path: Path) -> None:
    """Spark's Kafka source would retry without end; a continuous run waits, as every
    long-running process does."""
    settings = Settings(_env_file=None).model_copy(
        update={"domain": "tests.counters:AGGREGATES", "read_models": "tests.projections.test_read_your_writes:USER_READ_MODELS"}
    )
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    env = esk_env(settings, ESK_KAFKA__BOOTSTRAP_SERVERS=address, ESK_PROJECTIONS__WAREHOUSE_DIR=str(tmp_path))
    done = subprocess.run(
        [sys.executable, "-m", "esk", "project", "run", "counter_totals"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        f"error: no Kafka broker answered at {address}, which a run that is not --continuous needs: start one "
        "(`esk broker start`; `esk dev` starts its own), or set ESK_KAFKA__BOOTSTRAP_SERVERS to yours"
    )
    assert "Spark" not in done.stdout + done.stderr  # told before a driver started


def test_a_batchs_failure_is_told_by_the_read_models_own_exception() -> None:
    spark_said = (
        "[STREAM_FAILED] Query [id = 7, runId = 8] terminated with exception: [FOREACH_BATCH_USER_FUNCTION_ERROR] An error "
        "occurred in the user provided function in foreachBatch. Reason: An exception was raised by the Python Proxy. "
        "Return Message: Traceback (most recent call last):\n"
        '  File "/venv/py4j/clientserver.py", line 644, in _call_proxy\n'
        "    return_value = getattr(self.pool[obj_id], method)(*params)\n"
        '  File "/project/tickets/read_models.py", line 12, in board\n'
        '    raise ValueError("no such status: reopened")\n'
        "ValueError: no such status: reopened\n"
        "\tat org.apache.spark.sql.execution.streaming.MicroBatchExecution.runBatch(MicroBatchExecution.scala:800)\n"
    )
    told = str(RunFailed("ticket_board", RuntimeError(spark_said)))
    assert told.startswith("ticket_board failed: ValueError: no such status: reopened (in a batch: [STREAM_FAILED] Query [id = 7")
    assert "\n" not in told and len(told) < 300
    assert told.endswith(" Reason: An exception was …)"), told  # cut between words, and said to be
    assert str(RunFailed("ticket_board", OSError(28, "No space left on device"))) == "ticket_board failed: OSError: [Errno 28] No space left on device"
    udf = "An exception was thrown from the Python worker. Please see the stack trace below.\nTraceback (most recent call last):\n  ...\nValueError: kaboom\n"
    assert str(RunFailed("ticket_board", RuntimeError(udf))) == (
        "ticket_board failed: ValueError: kaboom (in a batch: An exception was thrown from the Python worker.)"
    )
    assert str(RunFailed("ticket_board", KeyError("amount"))) == "ticket_board failed: KeyError: 'amount'"
    # Spark's own, with its SQL state and the plan after; py4j's lead line before a Java error
    analysis = "[DELTA_MERGE_UNRESOLVED_EXPRESSION] Cannot resolve s.amount in UPDATE clause SQLSTATE: 42601;\n'MergeIntoTable (...)"
    assert str(RunFailed("ticket_board", RuntimeError(analysis))) == (
        "ticket_board failed: RuntimeError: [DELTA_MERGE_UNRESOLVED_EXPRESSION] Cannot resolve s.amount in UPDATE clause"
    )
    java = "An error occurred while calling o123.save.\n: java.io.IOException: No space left on device SQLSTATE: 58030\n\tat ..."
    assert str(RunFailed("ticket_board", RuntimeError(java))) == "ticket_board failed: java.io.IOException: No space left on device"


@pytest.mark.parametrize("returned", [None, "3", True, 2.0])
def test_an_apply_that_returns_no_count_of_rows_is_told_so(returned: object) -> None:
    with pytest.raises(ReadModelMistake) as told:
        runner._rows_written("board", returned)
    assert str(told.value) == (
        f"board's apply returned {type(returned).__name__}, not the rows it wrote: return what its writer's merge or append returns"
    )
    assert runner._rows_written("board", 7) == 7


def test_a_broker_away_is_told_by_the_kafka_clients_own_line() -> None:
    """A batch that failed reading its records: Spark's first line blames the read model's
    function, the Kafka client's line is deep in the traceback."""
    spark_said = (
        "[STREAM_FAILED] Query [id = 7, runId = 8] terminated with exception: [FOREACH_BATCH_USER_FUNCTION_ERROR] An error "
        "occurred in the user provided function in foreach batch sink. Reason: An exception was raised by the Python Proxy. "
        "Return Message: Traceback (most recent call last):\n"
        '  File "/venv/py4j/clientserver.py", line 644, in _call_proxy\n'
        "py4j.protocol.Py4JJavaError: An error occurred while calling o98.count.\n"
        ": org.apache.spark.SparkException: Job aborted due to stage failure: Task 0 in stage 3.0 failed 1 times, most recent "
        "failure: Lost task 0.0 in stage 3.0 (TID 5) (localhost executor driver): "
        "org.apache.kafka.common.errors.TimeoutException: Timeout of 30000ms expired before the position for partition "
        "t.orders.events-0 could be determined\n\tat org.apache.kafka.clients.consumer.internals.ClassicKafkaConsumer.position\n"
    )
    assert _kafka_cause(spark_said) == (
        "TimeoutException: Timeout of 30000ms expired before the position for partition t.orders.events-0 could be determined"
    )
    assert _kafka_cause("[STREAM_FAILED] no Kafka in it SQLSTATE: XX000\nmore") == "[STREAM_FAILED] no Kafka in it"
    # a one-shot run, which does not wait for the broker, says so in its failure
    assert str(RunFailed("ticket_board", RuntimeError(spark_said))) == (
        "ticket_board failed: no Kafka broker answered (TimeoutException: Timeout of 30000ms expired before the position "
        "for partition t.orders.events-0 could be determined)"
    )


class _Query:
    """What _StalledBatch reads of a streaming query."""

    def __init__(self) -> None:
        self.status: dict[str, Any] = {"isTriggerActive": False}
        self.lastProgress: dict[str, Any] | None = None


def test_a_batch_stalled_for_want_of_a_broker_is_told_once_and_its_end_once(
    monkeypatch: pytest.MonkeyPatch, runner_said: Callable[[], str]
) -> None:
    clock = [1000.0]
    answers = [True]
    asked: list[float] = []

    def broker_answers(_settings: Settings) -> bool:
        asked.append(clock[0])
        return answers[0]

    monkeypatch.setattr(runner.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(runner, "_broker_answers", broker_answers)
    watch = runner._StalledBatch(Settings(_env_file=None), "totals")
    query = _Query()

    def look(after_s: float) -> None:
        clock[0] += after_s
        watch.look(query)  # type: ignore[arg-type]

    look(0)
    query.status["isTriggerActive"] = True
    look(STALL_CHECK_S - 1)  # a batch in flight, not for long yet
    look(2)  # long: a broker answers, so it is only a long batch
    answers[0] = False
    look(1)  # asked at most once per STALL_CHECK_S
    assert len(asked) == 1 and runner_said() == ""
    look(STALL_CHECK_S)
    look(STALL_CHECK_S)
    assert runner_said().splitlines() == [f"totals: a batch has waited {2 * STALL_CHECK_S + 2:.0f}s and no Kafka broker answers: it goes on once one does"]
    assert len(asked) == 2, "told once: not asked again"
    query.lastProgress = {"batchId": 7}  # it went through
    look(1)
    assert runner_said().splitlines()[-1] == "totals: Kafka answers again: the batch went through"
    answers[0] = True
    look(STALL_CHECK_S + 1)  # the next batch: watched afresh
    assert len(asked) == 3 and len(runner_said().splitlines()) == 2
    # a trigger with nothing to read, waiting for the broker's offsets, then ending with no batch
    answers[0] = False
    look(STALL_CHECK_S)
    assert runner_said().splitlines()[-1].startswith("totals: a batch has waited")
    query.status["isTriggerActive"] = False
    look(1)
    assert runner_said().splitlines()[-1] == "totals: Kafka answers again"


@pytest.mark.parametrize(
    ("rows", "table", "fits"),
    [
        ("int", "bigint", True), ("bigint", "int", False), ("float", "double", True), ("bigint", "double", False),
        ("decimal(10,2)", "decimal(12,2)", True), ("decimal(10,2)", "decimal(10,1)", False), ("decimal(10,2)", "decimal(11,3)", True), ("decimal(10,2)", "decimal(10,3)", False),
        ("int", "decimal(12,2)", True), ("bigint", "decimal(12,2)", False), ("string", "bigint", False), ("date", "timestamp", False),
        ("array<int>", "array<int>", True), ("void", "string", True),
    ],
)
def test_an_appended_column_fits_its_table_column_as_it_is_or_widened_without_loss(spark: SparkSession, rows: str, table: str, fits: bool) -> None:
    from pyspark.sql.types import _parse_datatype_string

    assert catalog._fits(_parse_datatype_string(rows), _parse_datatype_string(table)) is fits
