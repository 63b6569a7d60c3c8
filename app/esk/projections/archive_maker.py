"""The session that makes the local driver's class archive (esk.projections.class_archive
runs it in a process of its own): `python -m esk.projections.archive_maker PATH`. Its JVM
writes the archive to PATH as it exits, having loaded the classes a read model's batch
loads."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from pyspark.sql import SparkSession

from ..settings import Settings
from .class_archive import TIMEOUT_S
from .session import spark_session


def _exercise(spark: SparkSession, workdir: Path) -> None:
    """What a read model's batch does, on a few rows: JSON decoding, aggregates, a window,
    joins, Delta's create, append, MERGE and read, Arrow both ways; its classes are the
    ones the archive holds."""
    from delta.tables import DeltaTable
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    rows = spark.createDataFrame(
        [(f'{{"k": "k{n % 3}", "n": {n}, "lines": [{{"qty": {n}}}]}}', n) for n in range(12)], "value string, offset long"
    )
    decoded = rows.select(F.from_json("value", "k string, n long, lines array<struct<qty: long>>").alias("e"), "offset")
    events = decoded.select("e.*", "offset").persist()
    totals = events.groupBy("k").agg(
        F.sum(F.aggregate("lines", F.lit(0).cast("long"), lambda acc, line: acc + line["qty"])).alias("total"),
        F.max_by("n", "offset").alias("n"),
        F.max("k").alias("last"),
    )
    ranked = events.withColumn("rank", F.row_number().over(Window.partitionBy("k").orderBy(F.col("n").desc())))
    source = totals.join(ranked.filter("rank = 1").select("k", "rank"), "k", "left")
    path = str(workdir / "table")
    DeltaTable.createIfNotExists(spark).location(path).addColumns(source.schema).execute()
    source.write.format("delta").mode("append").save(path)
    target = DeltaTable.forPath(spark, path).alias("t")
    target.merge(source.alias("s"), "t.k = s.k").whenMatchedUpdate(set={"total": "t.total + s.total"}).whenNotMatchedInsertAll().execute()
    table = spark.read.format("delta").load(path)
    spark.createDataFrame(table.toArrow()).join(F.broadcast(source.select("k")), "k").count()
    events.unpersist()


def main() -> None:
    """Runs the session that writes the archive to argv[1], and waits for its JVM to exit."""
    from pyspark import SparkContext

    destination = Path(sys.argv[1])
    spark = spark_session(Settings(), "esk-class-archive", archive_to=destination)
    with tempfile.TemporaryDirectory(prefix="esk-class-archive-") as workdir:
        _exercise(spark, Path(workdir))
    spark.stop()
    # The JVM writes the archive as it exits, which it does once its stdin closes; this
    # process's exit code is the JVM's, so a non-zero one leaves the archive unused.
    gateway = SparkContext._gateway
    process = getattr(gateway, "proc", None)
    if process is None or process.stdin is None:
        raise SystemExit("no JVM of this process to wait for")
    process.stdin.close()
    raise SystemExit(process.wait(TIMEOUT_S))


if __name__ == "__main__":
    main()
