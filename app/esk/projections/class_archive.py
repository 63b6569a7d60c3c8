"""Class data sharing for the local Spark driver: its JVM maps the classes of Spark, Delta
and their dependencies from an archive instead of loading and verifying them from the
jars, which is much of a short run's time (`esk project run` over a few events, `esk sql`;
docs/benchmarks.md).

The archive is made once per Java and set of jars, by a Spark session of its own that
writes it as its JVM exits (`-XX:ArchiveClassesAtExit`). It is taken into use only after
that JVM has exited cleanly: a JVM that maps a partly written archive dies (SIGBUS), so an
archive is written under a name of its own and renamed into place afterwards. `esk jars
spark` (and so `make setup`) makes it; a session that finds none runs without.

Run as a module, this is that session: `python -m esk.projections.class_archive PATH`.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from ..jars import cache_dir
from ..processes import alive

TIMEOUT_S = 600


def archive_path(jars: Sequence[Path]) -> Path:
    """Where the archive of this Java and these jars lives: an archive records the class
    path and the JVM it was made by, and another JVM or class path cannot use it."""
    import pyspark

    digest = hashlib.sha256()
    for part in (_java_identity(), pyspark.__version__, *(str(jar) for jar in jars)):
        digest.update(part.encode() + b"\0")
    return cache_dir() / "class-archives" / f"spark-{digest.hexdigest()[:12]}.jsa"


def sharing_options(jars: Sequence[Path]) -> list[str]:
    """The JVM options that map the archive, when there is one."""
    archive = archive_path(jars)
    return [f"-XX:SharedArchiveFile={archive}"] if archive.exists() else []


def make_archive(jars: Sequence[Path]) -> Path:
    """The archive for `jars`, made first if there is none (a Spark session in a process of
    its own, tens of seconds). Raises RuntimeError when the session fails."""
    archive = archive_path(jars)
    if archive.exists():
        return archive
    archive.parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned(archive)
    partial = archive.with_name(f"{archive.stem}.{os.getpid()}.partial")
    try:
        done = subprocess.run(
            [sys.executable, "-m", __name__, str(partial)], capture_output=True, text=True, timeout=TIMEOUT_S, check=False
        )
        if done.returncode != 0 or not partial.exists():
            tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-5:])
            raise RuntimeError(f"the session that makes the class archive failed (exit {done.returncode}): {tail}")
        os.replace(partial, archive)
    finally:
        partial.unlink(missing_ok=True)
    return archive


def _remove_abandoned(archive: Path) -> None:
    """Partial archives whose process is gone (killed while making one)."""
    for partial in archive.parent.glob(f"{archive.stem}.*.partial"):
        pid = partial.suffixes[-2].lstrip(".")
        if pid.isdigit() and not alive(int(pid)):
            partial.unlink(missing_ok=True)


def _java_identity() -> str:
    """The Java pyspark starts (JAVA_HOME's, else the first on PATH), and its build."""
    home = os.environ.get("JAVA_HOME")
    java = Path(home, "bin", "java") if home else Path(shutil.which("java") or "java")
    with contextlib.suppress(OSError):
        java = java.resolve()
        return f"{java}:{java.stat().st_mtime_ns}"
    return str(java)


def _exercise(spark: object, workdir: Path) -> None:
    """What a read model's batch does, on a few rows: JSON decoding, aggregates, a window,
    joins, Delta's create, append, MERGE and read, Arrow both ways; its classes are the
    ones the archive holds."""
    from delta.tables import DeltaTable
    from pyspark.sql import SparkSession, Window
    from pyspark.sql import functions as F

    assert isinstance(spark, SparkSession)
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

    from ..settings import Settings
    from .session import spark_session

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
