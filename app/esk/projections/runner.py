"""Runs a projection: Kafka events -> foreachBatch -> idempotent writes into Delta.

Exactly once: Structured Streaming may run a micro-batch again after a crash (the Delta
commit happened, the checkpoint's commit did not). Every write of a batch therefore carries
Delta's txnAppId/txnVersion (the batch id), and Delta skips a write whose (app id,
version) it has committed already. The app id includes the table generation, since a new
generation starts with a new checkpoint and batch ids from 0.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from delta.tables import DeltaTable
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.streaming.readwriter import DataStreamWriter
from rich.console import Console

from ..settings import Settings
from .catalog import BatchWriter, Projection, Tables
from .events import decode, event_stream, upcast
from .session import spark_session


@dataclass
class RunSummary:
    name: str
    generation: int
    batches: int = 0
    events: int = 0
    rows: int = 0
    lag: dict[str, int] = field(default_factory=dict)


def run(
    settings: Settings,
    projection: Projection,
    continuous: bool = False,
    rebuild: bool = False,
    console: Console | None = None,
    spark: SparkSession | None = None,
) -> RunSummary:
    console = console or Console(stderr=True)
    name = projection.model.name
    tables = Tables(settings.projections.warehouse_dir)
    current = tables.current_generation(name)
    generation = (current or 0) + 1 if rebuild or current is None else current
    spark = spark or spark_session(settings, f"esk-project-{name}")
    path = tables.path(name, generation)
    schema = spark.createDataFrame([], projection.columns).schema
    builder = DeltaTable.createIfNotExists(spark).location(str(path)).addColumns(schema)
    if projection.model.partition_by:
        builder = builder.partitionedBy(*projection.model.partition_by)
    table = builder.execute()
    summary = RunSummary(name, generation)
    app_id = f"esk.{settings.app}.{name}.g{generation}"

    def batch(decoded: DataFrame, batch_id: int) -> None:
        cached = decoded.persist()  # MERGE reads its source more than once
        try:
            count = cached.count()
            events = upcast(cached, settings, projection.model.categories)
            rows = projection.apply(spark, table, events, BatchWriter(spark, app_id, batch_id)) if count else 0
        finally:
            cached.unpersist()
        summary.batches += 1
        summary.events += count
        summary.rows += rows
        console.print(f"{name} g{generation} batch {batch_id}: {count:,} events, {rows:,} rows merged", highlight=False)

    def writer() -> DataStreamWriter:
        events = decode(event_stream(spark, settings, projection.model.categories))
        return events.writeStream.foreachBatch(batch).option("checkpointLocation", str(tables.checkpoint(name, generation)))

    query = writer().trigger(availableNow=True).start()
    query.awaitTermination()
    summary.lag = _lag(query.lastProgress)
    if current != generation:
        tables.switch(name, generation)  # caught up: readers move over now, never earlier
        console.print(f"{name}: readers now use generation {generation} ({path})", highlight=False)
    if continuous:
        query = writer().trigger(processingTime=f"{settings.projections.trigger_interval_s} seconds").start()
        try:
            while query.isActive:
                query.awaitTermination(round(settings.projections.trigger_interval_s * 2))
                summary.lag = _lag(query.lastProgress)
                console.print(f"{name} lag per partition: {summary.lag or 'none'}", highlight=False)
        except KeyboardInterrupt:
            pass
        finally:
            query.stop()
    return summary


def _lag(progress: dict[str, Any] | None) -> dict[str, int]:
    """Records between what was processed and the newest offsets, per topic partition."""
    if not progress:
        return {}
    lag: dict[str, int] = {}
    for source in progress.get("sources", []):
        end, latest = _offsets(source.get("endOffset")), _offsets(source.get("latestOffset"))
        for key, offset in latest.items():
            lag[key] = max(offset - end.get(key, 0), 0)
    return lag


def _offsets(raw: object) -> dict[str, int]:
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except ValueError:  # a source that has no offsets yet reports none
            return {}
    data = raw if isinstance(raw, dict) else {}
    return {f"{topic}[{p}]": int(o) for topic, parts in data.items() for p, o in parts.items()}
