"""The SparkSession of esk's jobs: local mode by default, Delta Lake and Spark's Kafka source
from jars resolved by Maven into esk's jar cache (esk.jars), never fetched by Spark at job start."""

from __future__ import annotations

import logging
import os
import re
import shlex
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import pyspark
from pyspark import SparkConf, SparkContext
from pyspark.logger import PySparkLogger
from pyspark.sql import SparkSession

from ..jars import jars_dir
from ..settings import Settings
from .class_archive import sharing_options

# Every `persist()` of a session where one of these is on makes Spark's cache manager clone
# the session to build the cache with them off, and the clone stays on the driver's heap
# after the `unpersist()`: a micro-batch caches its records, so a continuous run leaked a
# session a batch until its driver ran out of memory (docs/benchmarks.md). Off, the cache
# is built in the session itself. Neither changes a plan of esk's: no table is bucketed,
# and adaptive execution is off in a streaming query's batches.
CACHE_WITHOUT_CLONES: dict[str, str] = {
    "spark.sql.sources.bucketing.autoBucketedScan.enabled": "false",
    "spark.sql.adaptive.applyFinalStageShuffleOptimizations": "false",
}
# What Spark logs that tells an esk user nothing. When a stop ends a query on purpose: a
# warning that no job of its group was running (at every stop between batches, twice a
# query), and, when the stop cut a batch short in a local shuffle read, an ERROR for the
# interrupted read (whose exception, an InterruptedException, has no message: "null").
# And a warning at each micro-batch longer than the trigger interval, which a continuous
# run's small batches often are (0.5 s against about a second): its lag is what matters,
# and the run logs that when it changes.
_NOISE = (
    r".*Failed to cancel job group .*Cannot find active jobs for it.*",
    r"Error occurred while fetching local blocks, null",
    r"Current batch is falling behind\..*",
)
_QUIET_SET = "esk.quiet"
# What Spark logs of a job that fails computing rows: the executor's ERROR and the
# scheduler's WARN, a stack trace each, and the scheduler's ERROR that the job aborts.
TASK_FAILURE_LOGGERS = (
    "org.apache.spark.executor.Executor",
    "org.apache.spark.scheduler.TaskSetManager",
)
# And of a write that a failing task aborts: the task's ERROR (a stack trace) and a noop
# write's ERRORs that it aborts its commit and its job (the write a read model's probes end in).
WRITE_ABORT_LOGGERS = (
    "org.apache.spark.util.Utils",
    "org.apache.spark.sql.execution.datasources.v2.DataWritingSparkTask",
    "org.apache.spark.sql.execution.datasources.v2.OverwriteByExpressionExec",
)
# What Spark logs of a streaming query that its batch failed: an ERROR, the failure's traces
# (the JVM's and the batch function's) with it.
QUERY_FAILURE_LOGGER = "org.apache.spark.sql.execution.streaming.MicroBatchExecution"
# Spark's default log profile writes, at every start of a local driver, lines that tell a
# user nothing (package data, beside this module).
LOG_CONFIG = Path(__file__).with_name("log4j2.properties")
LOG_CONFIG_JSON = Path(__file__).with_name("log4j2-json.properties")  # laid over it: ESK_LOG_FORMAT=json
_VERSIONED = re.compile(r"^(?P<artifact>.+?)-\d[\w.\-]*\.jar$")


def extra_jars(configured: Path | None) -> list[Path]:
    """The resolved jars pyspark does not ship itself (a second copy of a jar that Spark
    already has only invites classpath conflicts)."""
    folder = jars_dir("spark", configured)
    shipped = {_artifact(p.name) for p in (Path(pyspark.__file__).parent / "jars").glob("*.jar")}
    jars = [p for p in sorted(folder.glob("*.jar")) if _artifact(p.name) not in shipped]
    if not any(p.name.startswith("delta-spark") for p in jars):
        raise RuntimeError(f"Delta and Kafka jars not found in {folder}: set ESK_PROJECTIONS__JARS_DIR to a folder that has them")
    return jars


def _artifact(filename: str) -> str:
    match = _VERSIONED.match(filename)
    return match.group("artifact") if match else filename


def spark_session(settings: Settings, app_name: str = "esk", archive_to: Path | None = None) -> SparkSession:
    """The session; in local mode its JVM maps the class archive when there is one, or
    writes one to `archive_to` as it exits (esk.projections.class_archive)."""
    p = settings.projections
    jars = extra_jars(p.jars_dir)
    conf: dict[str, str] = {
        "spark.app.name": app_name,
        "spark.jars": ",".join(str(j) for j in jars),
        "spark.sql.extensions": "io.delta.sql.DeltaSparkSessionExtension",
        "spark.sql.catalog.spark_catalog": "org.apache.spark.sql.delta.catalog.DeltaCatalog",
        "spark.sql.shuffle.partitions": str(p.shuffle_partitions),
        "spark.driver.memory": p.driver_memory,
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
        "spark.sql.session.timeZone": "UTC",
        # Spark makes its catalog's folder at the first catalog access, by default in the
        # working directory (which a container may have read-only); esk's tables are
        # addressed by path, so that folder stays empty, beside them.
        "spark.sql.warehouse.dir": str(Path(p.warehouse_dir).absolute() / "_spark"),
        "spark.sql.streaming.stopGracefullyOnShutdown": "true",
        # Spark's default ("(?i)url") and the client key esk hands the Kafka source
        # (events._pkcs8_key): redacted in plans, as the options' passwords are already.
        "spark.sql.redaction.options.regex": "(?i)url|keystore",
        **CACHE_WITHOUT_CLONES,
    }
    if not _submitted():
        # Local mode: the Python workers run the domain's upcasters, so they use this
        # interpreter (and its packages), not whatever `python3` is first on PATH.
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        java_options = [p.driver_java_options, *_class_sharing(jars, archive_to)]
        if p.spark_master.startswith("local"):
            # One machine: the driver on loopback, rather than on the address its host name
            # resolves to, with two warnings at every start that it had to choose (a
            # cluster's executors must reach it: not there).
            os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
            if "SPARK_CONF_DIR" not in os.environ:  # else its log4j2.properties is the user's choice
                # first: the JVM takes the last of two -D, and the user's options come after
                configs = [LOG_CONFIG, LOG_CONFIG_JSON] if settings.log_format == "json" else [LOG_CONFIG]
                java_options.insert(0, shlex.quote(f"-Dlog4j2.configurationFile={','.join(map(str, configs))}"))
        conf |= {
            "spark.master": p.spark_master,
            "spark.pyspark.python": sys.executable,
            "spark.driver.extraJavaOptions": " ".join(java_options).strip(),
        }
        if settings.log_format == "json" and SparkContext._active_spark_context is None:
            _driver_told_as_json(conf)
    spark = SparkSession.builder.config(map=dict(conf)).getOrCreate()
    _quiet_query_context_logs()
    spark.sparkContext.setLogLevel("WARN")
    _quiet(spark)
    return spark


def _quiet(spark: SparkSession) -> None:
    """Filters on the driver's root logger drop what Spark logs that tells nothing (_NOISE),
    those messages alone, once per JVM: a warning or an error at every stop of every read
    model, or at every batch, would be about nothing."""
    jvm: Any = spark.sparkContext._jvm
    if jvm.System.getProperty(_QUIET_SET) is not None:
        return
    log4j = jvm.org.apache.logging.log4j
    result = log4j.core.Filter.Result
    context = log4j.LogManager.getContext(False)
    root = context.getConfiguration().getRootLogger()
    for pattern in _NOISE:
        root.addFilter(log4j.core.filter.RegexFilter.createFilter(pattern, None, False, result.DENY, result.NEUTRAL))
    context.updateLoggers()
    jvm.System.setProperty(_QUIET_SET, "1")


class _Untold:
    """How many threads of this process keep each logger off (`loggers_off`), and
    the level each had before the first did."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.inside: dict[str, int] = {}
        self.levels: dict[str, Any] = {}


_UNTOLD = _Untold()


@contextmanager
def task_failures_untold(spark: SparkSession, writes: bool = False) -> Iterator[None]:
    """Spark's lines about failed tasks (TASK_FAILURE_LOGGERS; with `writes`, about the
    writes they abort as well: a JVM stack trace of Spark's code, twice a task) are not
    written while inside a batch's attempts: esk tells a batch's failure at an event in the
    read model's terms (the runner's `park`), and any other failure ends the query, which
    Spark tells with its traces; a read model's probes for a failed batch's event fail a
    job each on purpose; a batch's first attempt fails its job on purpose at an event of
    another schema version (the runner's versions guard). The loggers are the JVM's: another
    read model's task that fails meanwhile is told by its own batch's attempts the same way."""
    turn_on = loggers_off(spark, TASK_FAILURE_LOGGERS + (WRITE_ABORT_LOGGERS if writes else ()))
    try:
        yield
    finally:
        turn_on()


def loggers_off(spark: SparkSession, names: tuple[str, ...]) -> Callable[[], None]:
    """Turns the driver's loggers `names` off, and returns what turns them back on: each is
    on again once every thread that turned it off has done so."""
    jvm: Any = spark.sparkContext._jvm
    log4j = jvm.org.apache.logging.log4j
    with _UNTOLD.lock:
        for name in names:
            if not _UNTOLD.inside.get(name):
                _UNTOLD.levels[name] = log4j.LogManager.getLogger(name).getLevel()
                log4j.core.config.Configurator.setLevel(name, log4j.Level.OFF)
            _UNTOLD.inside[name] = _UNTOLD.inside.get(name, 0) + 1

    def turn_on() -> None:
        with _UNTOLD.lock:
            for name in names:
                _UNTOLD.inside[name] -= 1
                if not _UNTOLD.inside[name]:
                    log4j.core.config.Configurator.setLevel(name, _UNTOLD.levels.pop(name))

    return turn_on


def _class_sharing(jars: list[Path], archive_to: Path | None) -> list[str]:
    """Quoted: Spark splits the driver's Java options at spaces outside quotes, and the
    archive's path is the cache's, which may hold one."""
    options = [f"-XX:ArchiveClassesAtExit={archive_to}"] if archive_to is not None else sharing_options(jars)
    return [shlex.quote(option) for option in options]


def _driver_told_as_json(conf: dict[str, str]) -> None:
    """Starts the local driver's JVM with its stderr read here, a line at a time: log4j's
    lines are JSON already (LOG_CONFIG_JSON), and what the JVM writes around log4j (its
    notice of the incubator module Spark's launcher adds, at every start; a trace printed
    to System.err) goes on as a JSON log line of its own, so that JSON is all a log
    pipeline gets."""
    from pyspark.java_gateway import launch_gateway

    spark_conf = SparkConf(loadDefaults=False).setAll(list(conf.items()))
    gateway = launch_gateway(spark_conf, {"stderr": subprocess.PIPE})  # type: ignore[no-untyped-call]
    threading.Thread(target=_as_json_lines, args=(gateway.proc.stderr,), name="esk-driver-stderr", daemon=True).start()
    SparkContext(conf=spark_conf, gateway=gateway)  # the builder's getOrCreate takes it up


def _as_json_lines(stream: IO[bytes]) -> None:
    log = logging.getLogger("esk.spark.driver")
    for line in iter(stream.readline, b""):
        text = line.decode(errors="replace").rstrip()
        if text.startswith("{"):
            sys.stderr.write(text + "\n")
        elif text:
            log.warning(text)


def _submitted() -> bool:
    """Under spark-submit the master comes from the command line, not from esk's settings."""
    return "SPARK_SUBMIT_OPTS" in os.environ or os.environ.get("ESK_SPARK_SUBMITTED") == "1"


# pyspark logs every analysis error that has a query context, stack trace and all, on
# loggers of its own that bypass the root's handlers, before its caller handles the error:
# esk tells such errors in a line (`esk sql`, a read model's plan check).
PYSPARK_ERROR_LOGGERS = ("SQLQueryContextLogger", "DataFrameQueryContextLogger")


def _quiet_query_context_logs() -> None:
    for name in PYSPARK_ERROR_LOGGERS:
        # pyspark's own kind of logger: a plain one would refuse the fields it logs with
        PySparkLogger.getLogger(name).setLevel(logging.CRITICAL)
