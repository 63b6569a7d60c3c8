"""What a read model is, which ones the application has, and where their Delta tables
live. Imports no Spark, so the HTTP API and `import esk` do without it.

A read model is declared in the user's own code as a `Projection` (its `ReadModel`, the
table's columns, and how one batch of events merges in) and registered by the setting
`ESK_READ_MODELS` ("module:attribute" naming a list of them).

A table has generations: `<warehouse>/<name>/g<N>`, and the file `<warehouse>/<name>/CURRENT`
names the one readers use. `--rebuild` builds generation N+1 from the earliest offsets and
only then replaces CURRENT (atomically), so a reader never sees a half-built read model.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from ..domain.aggregate import AggregateType
from ..registry import by_name, load_object, load_optional
from ..settings import Settings
from .parking import ParkedAggregate, ParkedAggregates
from .run_lock import GenerationBusy, GenerationLock, Keeper

if TYPE_CHECKING:
    from pyarrow.dataset import Dataset
    from pyspark.sql import DataFrame, SparkSession
    from pyspark.sql.types import DataType, StructType

T = TypeVar("T")
# What `pip install 'esk[spark]'` brings (pyproject.toml), by the names modules import it by.
SPARK_EXTRA = frozenset({"pyspark", "delta", "deltalake", "pyarrow"})
_READ_MODEL_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]*")
_GENERATION_ENTRY = re.compile(r"g([0-9]+)(\.lock)?")  # a table or checkpoint folder, or a lock


@dataclass(frozen=True)
class ReadModel:
    name: str
    reads: tuple[AggregateType[Any], ...]  # the aggregate types whose event streams it reads
    description: str
    order_by: tuple[str, ...] = ()  # how readers get rows ("-col" = descending)
    partition_by: tuple[str, ...] = ()
    # Raised when the rows it has written would come out otherwise from its code now (a fix,
    # a new rule) though its columns stay: its table is then one of another version, as a
    # table of other columns is (a continuous run builds a new one; a one-shot run refuses).
    version: int = 1

    def __post_init__(self) -> None:
        # Its folder in the warehouse (beside esk's own `_checkpoints` and `_spark`), its
        # table in `esk sql`, and its URL.
        if not _READ_MODEL_NAME.fullmatch(self.name):
            raise ValueError(f"a read model's name is a letter, then letters, digits or _: not {self.name!r}")
        if isinstance(self.version, bool) or not isinstance(self.version, int) or self.version < 1:
            raise ValueError(f"a read model's version is a whole number from 1: not {self.version!r}")

    @property
    def categories(self) -> tuple[str, ...]:
        """The names of the aggregate types it reads (the `<app>.<type>.events` topics)."""
        return tuple(aggregate_type.name for aggregate_type in self.reads)


@dataclass(frozen=True)
class Merge:
    """How a batch's rows go into the table, as SQL over `t` (the table's row) and `s` (the
    batch's row). One spec serves both of BatchWriter's writers, so the expressions keep
    to what Spark SQL and delta-rs (DataFusion) read alike: columns, arithmetic,
    comparisons, AND/OR, IS NULL, coalesce."""

    on: str  # e.g. "t.account_id = s.account_id"
    update: Mapping[str, str] = field(default_factory=dict)  # column -> expression, when matched
    update_if: str | None = None
    insert: Mapping[str, str] | None = None  # column -> expression when not matched; None: all, from `s`
    insert_if: str | None = None
    delete_if: str | None = None  # a matched row is deleted where this holds (before any update)


# A lookup broadcasts the keys of a batch of at most this many events, and shuffles the
# keys of a bigger one: a 1 GB driver broadcast a few million keys, and failed on twelve
# million after minutes (docs/benchmarks.md).
BROADCAST_KEYS_MAX = 1_000_000


@dataclass(frozen=True)
class BatchWriter:
    """Idempotent writes of one micro-batch; `step` tells apart several writes of a batch.

    Each write records (txnAppId, txnVersion) = (app id and step, batch id) in the Delta
    log, and a write whose pair is there already is skipped, so a batch that Spark runs
    again after a crash writes nothing twice.

    Small batches are written by delta-rs on the driver: a Spark MERGE costs seconds of
    fixed work (jobs to plan, schedule, and rebuild the table's snapshot after it), far
    more than a few hundred rows need; delta-rs merges them in milliseconds. Big batches
    (a catch-up) are written by Spark, on the executors. `on_driver` is the runner's
    choice, by the batch's size."""

    spark: SparkSession
    app_id: str
    batch_id: int
    path: str  # the table's location: for appends, and for reading it beside a MERGE into it
    on_driver: bool = False
    schema: StructType | None = None  # the table's columns; None: read from the table
    events: int = 0  # the batch's: at least as many as the keys any lookup of it is given
    cached: list[DataFrame] = field(default_factory=list)  # by `cache`, until `release`
    written: list[str] = field(default_factory=list)  # the steps of the batch in the table now

    @property
    def columns(self) -> StructType:
        return self.schema if self.schema is not None else self.read().schema

    @property
    def planning(self) -> bool:
        """True while a run only plans the read model's `apply`, over no events at its start
        (PlanCheck), or probes a failed batch's events (Probe): side effects of its own (a
        log line, a metric) belong to real batches."""
        return False

    def read(self) -> DataFrame:
        """The table as a DataFrame of its own: a MERGE's source that reads the target
        must not share the target's DataFrame (`DeltaTable.toDF()`), whose columns the
        MERGE's conditions would then resolve ambiguously."""
        return self.spark.read.format("delta").load(self.path)

    def cache(self, frame: DataFrame) -> DataFrame:
        """`frame`, kept once computed until the batch ends: a DataFrame that a batch uses
        more than once (a MERGE's source built from it, a lookup's keys) is otherwise
        computed again for each use."""
        kept = frame.persist()
        self.cached.append(kept)
        return kept

    def release(self) -> None:
        """Drops what `cache` kept; the runner calls it when the batch ends."""
        while self.cached:
            self.cached.pop().unpersist()

    def lookup(self, keys: DataFrame, on: str | Sequence[str]) -> DataFrame:
        """The table's rows whose `on` columns match a row of `keys`: what a batch reads back
        of the table to compute its rows from (the orders of the customers it touches, say).

        A small batch's keys are collected and the table is read by delta-rs, filtered on
        them: Spark would first rebuild its snapshot of the table (which delta-rs's writes
        have moved on) and scan all of it, seconds a batch. A big batch joins the table
        with its keys, broadcast when the batch is small enough for the driver to hold all
        its keys (BROADCAST_KEYS_MAX), else by a shuffle: a catch-up after a long stop may
        touch millions of keys, and a broadcast the driver cannot hold fails the batch
        each time the query starts again."""
        from pyspark.sql import functions as F

        on = [on] if isinstance(on, str) else list(on)
        wanted = keys.select(*on).distinct()
        if not self.on_driver:
            if _empty(self.path):  # a catch-up's first batch: nothing to read, nor to plan a scan of
                return self.spark.createDataFrame([], self.columns)
            table = self.read()
            return table.join(F.broadcast(wanted) if self.events <= BROADCAST_KEYS_MAX else wanted, on).select(*table.columns)
        columns = self.columns
        rows = _driver_lookup(self.path, wanted.toArrow(), columns)
        found = self.spark.createDataFrame(rows if rows.num_rows else [], columns)
        # Each column was filtered on its own: a composite key's exact match is a join.
        return found if len(on) == 1 else found.join(F.broadcast(wanted), on).select(*found.columns)

    def merge(self, source: DataFrame, spec: Merge, step: str = "merge") -> int:
        """`source` merged into the table as `spec` says; returns the rows inserted or updated."""
        if self.on_driver:
            return self._on_driver(step, lambda table, txn: _driver_merge(table, source, spec, txn))
        if _empty(self.path):
            # Nothing to match (a new table's catch-up): the MERGE would insert what its
            # insert clause takes, at the cost of a join with the table and a copy of the
            # source; an append does it in one pass.
            return self.append(_inserted(source, spec, self.columns), step)
        return self.run(step, lambda: _spark_merged(_spark_merge(self.spark, self.path, source, spec).execute()))

    def append(self, rows: DataFrame, step: str = "append") -> int:
        """`rows` added to the table; returns how many."""
        if self.on_driver:
            return self._on_driver(step, lambda table, txn: _driver_append(table, rows, txn))
        from deltalake import DeltaTable

        before = DeltaTable(self.path).version()
        # A DataFrame write takes the transaction from its own options as well as from the
        # session's settings (run's): both, so either reading holds.
        txn = {"txnAppId": f"{self.app_id}.{step}", "txnVersion": str(self.batch_id)}
        self.run(step, lambda: rows.write.format("delta").mode("append").options(**txn).save(self.path))
        # The count from the commit's metrics: counting `rows` would run its plan twice
        # (none when Delta skipped it, written before a crash).
        table = DeltaTable(self.path)
        since = table.history(table.version() - before) if table.version() > before else []
        return sum(int(c["operationMetrics"].get("numOutputRows", 0)) for c in since if c.get("operation") == "WRITE")

    def run(self, step: str, write: Callable[[], T]) -> T:
        """`write()` (Spark's), made idempotent; returns what it returns."""
        transaction = {
            "spark.databricks.delta.write.txnAppId": f"{self.app_id}.{step}",
            "spark.databricks.delta.write.txnVersion": str(self.batch_id),
        }
        with session_conf(self.spark, transaction):
            done = write()
        self.written.append(step)
        return done

    def _on_driver(self, step: str, write: Callable[[Any, Any], int]) -> int:
        """`write(table, transaction)` with delta-rs, unless this batch's write is in the
        log already. The check and the write are not atomic; they need not be, as one
        streaming query is a table generation's only writer."""
        from deltalake import DeltaTable, Transaction

        app_id = f"{self.app_id}.{step}"
        table = DeltaTable(self.path)
        written = table.transaction_version(app_id)  # batch ids start at 0: not `or -1`
        done = 0 if written is not None and written >= self.batch_id else write(table, Transaction(app_id, self.batch_id))
        self.written.append(step)
        return done


class ReadModelMistake(TypeError):
    """A read model's code asks for what its batches cannot give: an event of another
    aggregate type, a type it does not read, a column its table does not have."""


class PlanEnds(Exception):
    """A write PlanCheck does not make: the plan is checked up to it."""


@dataclass(frozen=True)
class PlanCheck(BatchWriter):
    """A BatchWriter that writes nothing. A read model's `apply`, given it and no events at
    a run's start, has Spark analyse each DataFrame it builds, and each Merge checked
    against the table's columns: a mistake in a read model (a column its rows do not
    have, an event of a type it does not read) is told before the query starts, not at
    the first batch that holds an event. What it would write is noted (`writes`): each
    write's kind and step, and a Merge's spec."""

    writes: list[list[Any]] = field(default_factory=list)

    def fingerprint(self) -> str:
        """The writes noted, as a short digest: the same for the same specs, whatever their
        whitespace or the order of a mapping's columns."""
        return hashlib.sha256(json.dumps(self.writes).encode()).hexdigest()[:16]

    @property
    def planning(self) -> bool:
        return True

    def read(self) -> DataFrame:
        return self.spark.createDataFrame([], self.columns)

    def cache(self, frame: DataFrame) -> DataFrame:
        return frame

    def lookup(self, keys: DataFrame, on: str | Sequence[str]) -> DataFrame:
        on = [on] if isinstance(on, str) else list(on)
        keys.select(*on)
        self._columns_held("its lookup is on", on)
        return self.read()

    def merge(self, source: DataFrame, spec: Merge, step: str = "merge") -> int:
        from pyspark.sql import functions as F

        self._columns_held("its Merge sets", [*spec.update, *(spec.insert or {})])
        # A small batch's MERGE is delta-rs's, which casts a text to a number as it writes
        # it, and fails the batch on one that is not: no event is told as the one to park,
        # as a cast in Spark's code would be.
        held = {f.name: f.dataType for f in self.columns.fields}
        if unfit := [f"{f.name} as {f.dataType.simpleString()} for its {held[f.name].simpleString()} column"
                     for f in source.schema.fields
                     if f.name in held and f.name in _written(spec, held) and not _same_kind(f.dataType, held[f.name])]:  # fmt: skip
            raise ReadModelMistake(f"its Merge's rows hold {', '.join(unfit)}: cast them in its code (`.cast(...)`) as the table holds them")
        conditions = [spec.update_if, spec.insert_if, spec.delete_if]
        expressions = [*spec.update.values(), *(spec.insert or {}).values(), *(c for c in conditions if c)]
        # As the MERGE resolves them: `t.` the table's columns, `s.` the batch's
        self.read().alias("t").join(source.alias("s"), F.expr(spec.on), "full").select(*map(F.expr, expressions))
        _inserted(source, spec, self.columns)
        _planned_by_delta_rs(self.columns, source.schema, spec)
        self.writes.append(["merge", step, _as_noted(spec)])
        return 0

    def append(self, rows: DataFrame, step: str = "append") -> int:
        self._columns_held("it appends", rows.columns)
        # An append writes its rows' own types: delta-rs (a small batch's writer) casts them
        # to the table's as it can, a 1.5 to 1, "3" to 3, and Spark refuses some: what
        # would not fit as it is is a mistake, told now.
        held = {f.name: f.dataType for f in self.columns.fields}
        if unfit := [f"{f.name} as {f.dataType.simpleString()} into its {held[f.name].simpleString()} column"
                     for f in rows.schema.fields if not _fits(f.dataType, held[f.name])]:  # fmt: skip
            raise ReadModelMistake(f"it appends {', '.join(unfit)}: cast them in its code (`.cast(...)`) to append them as the table holds them")
        self.writes.append(["append", step])
        return 0

    def run(self, step: str, write: Callable[[], T]) -> T:
        self.writes.append(["run", step])
        raise PlanEnds(step)

    def _columns_held(self, what: str, columns: Sequence[str]) -> None:
        held = self.columns.fieldNames()
        if unknown := list(dict.fromkeys(column for column in columns if column not in held)):  # once each (update and insert)
            raise ReadModelMistake(f"{what} {', '.join(unknown)}, which its table does not have (its columns: {', '.join(held)})")


_INTEGRAL = ("byte", "short", "int", "bigint")


def _fits(rows: DataType, table: DataType) -> bool:
    """Whether values of `rows` go into a column of `table` as they are: the same type (its
    nullability aside), none (a null literal), or one that widens without loss."""
    from pyspark.sql.types import DecimalType, NullType

    given, held = rows.simpleString(), table.simpleString()
    if given == held or isinstance(rows, NullType):
        return True
    if given in _INTEGRAL and held in _INTEGRAL:
        return _INTEGRAL.index(given) <= _INTEGRAL.index(held)
    if held == "double":
        return given in ("float", "byte", "short", "int")
    if isinstance(table, DecimalType):
        digits = {"byte": 3, "short": 5, "int": 10, "bigint": 19}
        if isinstance(rows, DecimalType):
            return rows.scale <= table.scale and rows.precision - rows.scale <= table.precision - table.scale
        return given in digits and digits[given] <= table.precision - table.scale
    return False


def _written(spec: Merge, table: Mapping[str, DataType]) -> set[str]:
    """The batch's columns `spec` writes into the table: each of the table's names when it
    inserts all, else those its expressions name as `s.<column>`."""
    if spec.insert is None:
        return set(table)
    return set(re.findall(r"\bs\.`?(\w+)", " ".join([*spec.update.values(), *spec.insert.values()])))


def _same_kind(rows: DataType, table: DataType) -> bool:
    """Whether values of `rows` and of `table` are of one kind (numbers, text, a time:
    a date and a timestamp are one); a null literal's and nested types' are not judged."""
    from pyspark.sql.types import ArrayType, DateType, MapType, NullType, NumericType, StructType, TimestampNTZType, TimestampType

    if isinstance(rows, NullType | ArrayType | MapType | StructType) or isinstance(table, ArrayType | MapType | StructType):
        return True
    times = DateType | TimestampType | TimestampNTZType
    if isinstance(rows, times) or isinstance(table, times):
        return isinstance(rows, times) and isinstance(table, times)
    if isinstance(rows, NumericType) or isinstance(table, NumericType):
        return isinstance(rows, NumericType) and isinstance(table, NumericType)
    return rows.typeName() == table.typeName()


def _as_noted(spec: Merge) -> list[Any]:
    def sql(text: str | None) -> str | None:
        return None if text is None else " ".join(text.split())

    def columns(mapping: Mapping[str, str] | None) -> list[list[str | None]] | None:
        return None if mapping is None else sorted([column, sql(expression)] for column, expression in mapping.items())

    return [sql(spec.on), columns(spec.update), sql(spec.update_if), columns(spec.insert), sql(spec.insert_if), sql(spec.delete_if)]


@dataclass(frozen=True)
class Probe(BatchWriter):
    """A BatchWriter that computes each write's rows and writes none (Spark's `noop`
    format): the runner probes parts of a batch that failed with it, to find the event
    that fails it (parking.py). A write of the read model's own (`run`) ends a probe,
    which then counts as passing: what that write does cannot be probed."""

    @property
    def planning(self) -> bool:
        return True

    def merge(self, source: DataFrame, spec: Merge, step: str = "merge") -> int:
        return self.append(source, step)

    def append(self, rows: DataFrame, step: str = "append") -> int:
        rows.write.format("noop").mode("overwrite").save()
        return 0

    def run(self, step: str, write: Callable[[], T]) -> T:
        raise PlanEnds(step)


@contextmanager
def session_conf(session: SparkSession, values: Mapping[str, str]) -> Iterator[None]:
    """`values` set on the session's conf for the block, then as they were before."""
    conf = session.conf
    before = {key: conf.get(key, None) for key in values}
    for key, value in values.items():
        conf.set(key, value)
    try:
        yield
    finally:
        for key, earlier in before.items():
            if earlier is None:
                conf.unset(key)
            else:
                conf.set(key, earlier)


def _driver_lookup(path: str, wanted: Any, schema: StructType) -> Any:
    """The rows of the Delta table at `path` whose columns hold one of `wanted`'s values
    (an Arrow table of key columns), as Arrow of `schema`'s types."""
    import functools
    import operator

    import pyarrow.compute as pc
    from pyspark.sql.pandas.types import to_arrow_schema

    target = to_arrow_schema(schema)
    if not wanted.num_rows:
        return target.empty_table()
    # As the table's type: delta-rs writes strings as string_view, which isin will not
    # compare with the keys' string.
    predicate = functools.reduce(
        operator.and_, [pc.field(c).cast(target.field(c).type).isin(wanted[c]) for c in wanted.column_names]
    )
    rows = arrow_dataset(path).to_table(filter=predicate)
    return rows.select(target.names).cast(target)


def arrow_dataset(path: str | Path) -> Dataset:
    """The Delta table's current files as a pyarrow dataset, read through pyarrow's own
    filesystem. delta-rs's default is one written in Python, which Arrow's I/O threads
    call back into: a process that exited while a read's I/O was in flight crashed or hung
    in the interpreter's teardown (docs/benchmarks.md)."""
    import pyarrow.fs as pa_fs
    from deltalake import DeltaTable

    return DeltaTable(str(path)).to_pyarrow_dataset(filesystem=pa_fs.SubTreeFileSystem(str(path), pa_fs.LocalFileSystem()))


def _empty(path: str) -> bool:
    from deltalake import DeltaTable

    return not DeltaTable(path).file_uris()


def _inserted(source: DataFrame, spec: Merge, table: StructType) -> DataFrame:
    """The rows a MERGE of `source` into an empty table inserts, as the table's columns
    (of the table's types, as a MERGE would cast them)."""
    from pyspark.sql import functions as F

    rows = source.alias("s")
    if spec.insert_if:
        rows = rows.filter(F.expr(spec.insert_if))
    values = spec.insert if spec.insert is not None else {field.name: f"s.{field.name}" for field in table.fields}
    types = {field.name: field.dataType for field in table.fields}
    return rows.select(*[F.expr(expression).cast(types[column]).alias(column) for column, expression in values.items()])


def _spark_merge(spark: SparkSession, path: str, source: DataFrame, spec: Merge) -> Any:
    from delta.tables import DeltaTable

    merge = DeltaTable.forPath(spark, path).alias("t").merge(source.alias("s"), spec.on)
    if spec.delete_if:
        merge = merge.whenMatchedDelete(condition=spec.delete_if)
    if spec.update:
        merge = merge.whenMatchedUpdate(condition=spec.update_if, set=dict(spec.update))
    if spec.insert is None:
        return merge.whenNotMatchedInsertAll(condition=spec.insert_if)
    return merge.whenNotMatchedInsert(condition=spec.insert_if or "true", values=dict(spec.insert))


def _spark_merged(metrics: DataFrame) -> int:
    """The rows a Spark MERGE inserted or updated, from the metrics row it returns
    (counting the source again would run its whole plan once more)."""
    row = metrics.first()
    return 0 if row is None else int(row["num_inserted_rows"]) + int(row["num_updated_rows"])


def _driver_merge(table: Any, source: DataFrame, spec: Merge, transaction: Any) -> int:
    from deltalake import CommitProperties

    rows = source.toArrow()
    if not rows.num_rows:
        return 0
    metrics = _delta_rs_merge(table, rows, spec, CommitProperties(app_transactions=[transaction])).execute()
    return int(metrics["num_target_rows_inserted"]) + int(metrics["num_target_rows_updated"])


def _delta_rs_merge(table: Any, rows: Any, spec: Merge, commit: Any = None) -> Any:
    """delta-rs's MERGE of `rows` (Arrow) into `table` as `spec` says, to execute."""
    merge = table.merge(rows, spec.on, source_alias="s", target_alias="t", commit_properties=commit)
    if spec.delete_if:
        merge = merge.when_matched_delete(predicate=spec.delete_if)
    if spec.update:
        merge = merge.when_matched_update(updates=dict(spec.update), predicate=spec.update_if)
    if spec.insert is None:
        return merge.when_not_matched_insert_all(predicate=spec.insert_if)
    return merge.when_not_matched_insert(updates=dict(spec.insert), predicate=spec.insert_if)


def _planned_by_delta_rs(table: StructType, rows: StructType, spec: Merge) -> None:
    """Has delta-rs (a small batch's writer) plan `spec` as it would a batch's rows into the
    table, on an empty table of its columns and no rows: an expression DataFusion does not
    read as Spark does (a function only Spark has, a number added to a text) is a mistake
    told at the start, not a failure of the first small batch, that stops the run."""
    import tempfile

    from deltalake import DeltaTable, write_deltalake
    from deltalake.exceptions import DeltaError
    from pyspark.sql.pandas.types import to_arrow_schema

    with tempfile.TemporaryDirectory(prefix="esk-merge-plan-") as scratch:
        write_deltalake(scratch, to_arrow_schema(table).empty_table())
        try:
            _delta_rs_merge(DeltaTable(scratch), to_arrow_schema(rows).empty_table(), spec).execute()
        except DeltaError as error:
            raise ReadModelMistake(f"its Merge is one delta-rs, a small batch's writer, cannot run: {_delta_rs_reason(error)}") from None


def _delta_rs_reason(error: Exception) -> str:
    """delta-rs's error in a line, without the wrappers it nests it in."""
    told = re.sub(r"(Generic DeltaTable error|External error): ", "", str(error))
    return " ".join(told.split())


def _driver_append(table: Any, rows: DataFrame, transaction: Any) -> int:
    from deltalake import CommitProperties, write_deltalake

    data = rows.toArrow()
    if data.num_rows:
        write_deltalake(table, data, mode="append", commit_properties=CommitProperties(app_transactions=[transaction]))
    return int(data.num_rows)


@dataclass(frozen=True)
class Projection:
    """A read model's Spark logic: the table's columns, and how one batch of events merges in."""

    model: ReadModel
    columns: str  # DDL, e.g. "account_id STRING, balance BIGINT"
    # (one batch of decoded events, its writer) -> rows written, through writer.merge/append
    apply: Callable[[DataFrame, BatchWriter], int]


def configured_read_models(settings: Settings) -> dict[str, Projection]:
    """The application's read models. A project may have none: only when ESK_READ_MODELS
    was set is a module that is not there an error; the default finds the module if it is."""
    return load_optional(settings.read_models, "read_models" in settings.model_fields_set, load_read_models)


def load_read_models(spec: str) -> dict[str, Projection]:
    """The read models `spec` ("module:attribute") names, by name."""
    return by_name(
        load_object(spec, "ESK_READ_MODELS"), spec, Projection, "a Projection", lambda p: p.model.name, "read model"
    )


def select_read_models(projections: Mapping[str, Projection], names: Sequence[str], every: bool) -> list[Projection]:
    """The read models a run is asked for, by name or all of them (`every`); ValueError
    says what is wrong with the request."""
    if every and names:
        raise ValueError("name the read models to run or give --all, not both")
    if not every and not names:
        raise ValueError("name the read models to run, or give --all")
    if every:
        if not projections:
            raise ValueError("the project has no read models (ESK_READ_MODELS)")
        return list(projections.values())
    unknown = [name for name in names if name not in projections]
    if unknown:
        raise ValueError(f"no read model {', '.join(map(repr, unknown))}; `esk project list` shows them")
    return [projections[name] for name in dict.fromkeys(names)]


def needs_spark_extra(error: ImportError) -> bool:
    """Whether what `error` found missing is esk's spark extra's, not the user's own."""
    return isinstance(error, ModuleNotFoundError) and (error.name or "").partition(".")[0] in SPARK_EXTRA


@dataclass(frozen=True)
class Keepers:
    """Who keeps a read model up, as one look at the warehouse saw it: the generation
    readers use (None: none built yet), and the holder of each generation's run lock."""

    current: int | None
    runs: dict[int, str]
    held_up: dict[int, str] = field(default_factory=dict)  # why a run is held up, by generation
    left_out: Keeper | None = None  # a driver that left the read model out of its run: who, and why

    def held_up_reader(self) -> str | None:
        """Why the run that readers wait on is held up, if it is: the one keeping the
        generation they use, or else the one building the next (or the first)."""
        current = self.current or 0
        for generation in (current, current + 1):
            if generation in self.runs:
                return self.held_up.get(generation)
        return None

    def standing_still(self) -> int | None:
        """The generation readers use, when no run keeps it while one builds the next beside
        it: readers see it stand still until the next has caught up."""
        current = self.current
        return current if current is not None and current not in self.runs and current + 1 in self.runs else None


class Tables:
    def __init__(self, warehouse: Path) -> None:
        # Absolute: Delta's table builder reads a relative location such as the default
        # `.esk/warehouse/...` as a table name, and refuses it.
        self.warehouse = Path(warehouse).absolute()

    def current_generation(self, name: str) -> int | None:
        return self._pointed(name, "CURRENT")

    def offered(self, name: str) -> int | None:
        """A generation a one-shot rebuild caught up and offered to the run that keeps the
        one readers use (a continuous run), which brings it to where its own stands, then
        switches readers (runner's hand-over); None: none offered."""
        return self._pointed(name, "OFFERED")

    def offer(self, name: str, generation: int) -> None:
        self._point(name, "OFFERED", generation)

    def withdraw(self, name: str, generation: int) -> None:
        """The offer of `generation` ends: taken up, declined, or given up on."""
        if self.offered(name) == generation:
            (self.warehouse / name / "OFFERED").unlink(missing_ok=True)

    def _pointed(self, name: str, pointer: str) -> int | None:
        try:
            return int((self.warehouse / name / pointer).read_text().strip().lstrip("g"))
        except (FileNotFoundError, ValueError):
            return None

    def _point(self, name: str, pointer: str, generation: int) -> None:
        """`pointer` at `generation`: a rename, so a reader sees the old or the new, never neither."""
        path = self.warehouse / name / pointer
        path.parent.mkdir(parents=True, exist_ok=True)
        staged = path.with_suffix(".next")
        staged.write_text(f"g{generation}\n")
        os.replace(staged, path)

    def path(self, name: str, generation: int) -> Path:
        return self.warehouse / name / f"g{generation}"

    def current_path(self, name: str) -> Path | None:
        generation = self.current_generation(name)
        return None if generation is None else self.path(name, generation)

    def checkpoint(self, name: str, generation: int) -> Path:
        return self.warehouse / "_checkpoints" / name / f"g{generation}"

    def parked(self, name: str, generation: int) -> ParkedAggregates:
        """The aggregates the generation holds back (parking.py): in its checkpoint folder,
        which goes when the generation starts over or is retired."""
        return ParkedAggregates(self.checkpoint(name, generation))

    def parked_in(self, name: str, generation: int | None) -> list[ParkedAggregate]:
        """What `parked` holds for `generation`; none when there is none (nothing built)."""
        return [] if generation is None else self.parked(name, generation).load()

    def start_over(self, name: str, generation: int) -> None:
        """Removes a generation readers do not use (a rebuild stopped before its switch, one
        readers left): its table, and its checkpoint with the aggregates it parked. The
        caller holds its lock."""
        for folder in (self.path(name, generation), self.checkpoint(name, generation)):
            if folder.exists():
                shutil.rmtree(folder)

    def left_out_note(self, name: str) -> GenerationLock:
        """The note a driver that left the read model out holds for as long as it runs
        (runner.run_several): why, for readers and `esk project list`, which would otherwise
        see only that no run keeps it. A lock, so that it goes with the driver."""
        return GenerationLock(self.warehouse / "_checkpoints" / f"{name}.left-out.lock", name, 0)

    def run_lock(self, name: str, generation: int) -> GenerationLock:
        """The lock a run of the generation holds (run_lock.py): beside its checkpoint, which
        a run starting the generation over removes, and out of readers' way."""
        return GenerationLock(self.checkpoint(name, generation).with_suffix(".lock"), name, generation)

    def keepers(self, name: str) -> Keepers:
        """The runs keeping `name` now, by generation: the one readers use and the one a
        rebuild would build next. A continuous run waiting as a standby holds nothing."""
        current = self.current_generation(name)
        generations = [1] if current is None else [current, current + 1]
        keepers = {g: keeper for g in generations if (keeper := self.run_lock(name, g).keeper()) is not None}
        return Keepers(
            current,
            {g: k.who for g, k in keepers.items()},
            {g: k.held_up for g, k in keepers.items() if k.held_up is not None},
            self.left_out_note(name).keeper(),
        )

    def generations(self, name: str) -> list[int]:
        """Every generation of `name` with something on disk: a table, a checkpoint, a lock."""
        found: set[int] = set()
        for folder in (self.warehouse / name, self.warehouse / "_checkpoints" / name):
            if folder.is_dir():
                found.update(int(m.group(1)) for entry in folder.iterdir() if (m := _GENERATION_ENTRY.fullmatch(entry.name)))
        return sorted(found)

    def retire(self, name: str, unused_for_s: float) -> list[int]:
        """Removes the generations readers left (older than the one they use: a rebuild
        switched them), table, checkpoint and lock, once readers have used the newer one
        for `unused_for_s`: a read that chose an old one just before the switch has ended
        by then. One that a run still keeps stays (it is about to follow readers), and so
        does everything newer. The removed generations, oldest first."""
        current = self.current_generation(name)
        try:
            switched = (self.warehouse / name / "CURRENT").stat().st_mtime
        except FileNotFoundError:
            return []
        if current is None or self._now(name) - switched < unused_for_s:
            return []
        removed = []
        for generation in (g for g in self.generations(name) if g < current):
            lock = self.run_lock(name, generation)
            try:
                lock.acquire()
            except GenerationBusy:
                continue
            with lock:
                self.start_over(name, generation)
                lock.path.unlink()  # last: a generation with a folder left is found again next time
            removed.append(generation)
        return removed

    def _now(self, name: str) -> float:
        """Now by the clock of the switch's time: the file system's (an NFS server's), which
        this host's may be far from; this host's where the file cannot be touched (made by
        another user of a shared warehouse)."""
        clock = self.warehouse / name / ".clock"
        try:
            clock.touch()
            return clock.stat().st_mtime
        except OSError:
            return time.time()

    def switch(self, name: str, generation: int) -> None:
        """Point readers at `generation`, atomically."""
        self._point(name, "CURRENT", generation)


