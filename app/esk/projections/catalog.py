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

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from ..domain.aggregate import AggregateType
from ..registry import by_name, load_object, load_optional
from ..settings import Settings

if TYPE_CHECKING:
    from delta.tables import DeltaTable
    from pyspark.sql import DataFrame, SparkSession

T = TypeVar("T")


@dataclass(frozen=True)
class ReadModel:
    name: str
    reads: tuple[AggregateType[Any], ...]  # the aggregate types whose event streams it reads
    description: str
    order_by: tuple[str, ...] = ()  # how readers get rows ("-col" = descending)
    partition_by: tuple[str, ...] = ()

    @property
    def categories(self) -> tuple[str, ...]:
        """The names of the aggregate types it reads (the `<app>.<type>.events` topics)."""
        return tuple(aggregate_type.name for aggregate_type in self.reads)


@dataclass(frozen=True)
class BatchWriter:
    """Idempotent writes of one micro-batch; `step` tells apart several writes of a batch.

    Delta skips a write whose (txnAppId, txnVersion) it has committed already, so a batch
    that Spark runs again after a crash writes nothing twice."""

    spark: SparkSession
    app_id: str
    batch_id: int
    path: str  # the table's location: for appends, and for reading it beside a MERGE into it

    def read(self) -> DataFrame:
        """The table as a DataFrame of its own: a MERGE's source that reads the target
        must not share the target's DataFrame (`DeltaTable.toDF()`), whose columns the
        MERGE's conditions would then resolve ambiguously."""
        return self.spark.read.format("delta").load(self.path)

    def run(self, step: str, write: Callable[[], T]) -> T:
        """`write()`, made idempotent; returns what it returns (a MERGE's metrics row, say)."""
        conf = self.spark.conf
        conf.set("spark.databricks.delta.write.txnAppId", f"{self.app_id}.{step}")
        conf.set("spark.databricks.delta.write.txnVersion", str(self.batch_id))
        try:
            return write()
        finally:
            conf.unset("spark.databricks.delta.write.txnAppId")
            conf.unset("spark.databricks.delta.write.txnVersion")


@dataclass(frozen=True)
class Projection:
    """A read model's Spark logic: the table's columns, and how one batch of events merges in."""

    model: ReadModel
    columns: str  # DDL, e.g. "account_id STRING, balance BIGINT"
    # (spark, table, one batch of decoded events, writer) -> rows written
    apply: Callable[[SparkSession, DeltaTable, DataFrame, BatchWriter], int]


def configured_read_models(settings: Settings) -> dict[str, Projection]:
    """The application's read models. A project may have none: only when ESK_READ_MODELS
    was set is a module that is not there an error; the default finds the module if it is."""
    return load_optional(settings.read_models, "read_models" in settings.model_fields_set, load_read_models)


def load_read_models(spec: str) -> dict[str, Projection]:
    """The read models `spec` ("module:attribute") names, by name."""
    return by_name(
        load_object(spec, "ESK_READ_MODELS"), spec, Projection, "a Projection", lambda p: p.model.name, "read model"
    )


class Tables:
    def __init__(self, warehouse: Path) -> None:
        self.warehouse = Path(warehouse)

    def current_generation(self, name: str) -> int | None:
        try:
            return int((self.warehouse / name / "CURRENT").read_text().strip().lstrip("g"))
        except (FileNotFoundError, ValueError):
            return None

    def path(self, name: str, generation: int) -> Path:
        return self.warehouse / name / f"g{generation}"

    def current_path(self, name: str) -> Path | None:
        generation = self.current_generation(name)
        return None if generation is None else self.path(name, generation)

    def checkpoint(self, name: str, generation: int) -> Path:
        return self.warehouse / "_checkpoints" / name / f"g{generation}"

    def switch(self, name: str, generation: int) -> None:
        """Point readers at `generation`: a rename, so they see the old or the new, never neither."""
        pointer = self.warehouse / name / "CURRENT"
        pointer.parent.mkdir(parents=True, exist_ok=True)
        staged = pointer.with_suffix(".next")
        staged.write_text(f"g{generation}\n")
        os.replace(staged, pointer)


