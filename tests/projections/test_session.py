"""esk's Spark session keeps no state per cached DataFrame: a continuous run caches each
micro-batch's records, and a session left behind by every cache filled the driver's heap
within half an hour."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("pyspark")

from esk.projections.session import spark_session
from esk.settings import Settings

pytestmark = pytest.mark.spark

SESSION_CLASS = "org.apache.spark.sql.classic.SparkSession"


def _live_sessions(jvm_pid: int) -> int:
    """SparkSession objects the JVM still reaches, after a full collection (`jmap -histo:live`)."""
    jmap = shutil.which("jmap")
    assert jmap, "jmap (the JDK's) is needed to count the driver's live objects"
    histogram = subprocess.run([jmap, "-histo:live", str(jvm_pid)], capture_output=True, text=True, check=True).stdout
    match = re.search(rf"^\s*\d+:\s+(\d+)\s+\d+\s+{re.escape(SESSION_CLASS)}\s*$", histogram, re.MULTILINE)
    return int(match.group(1)) if match else 0


def test_caching_a_dataframe_leaves_no_session_behind() -> None:
    spark = spark_session(Settings(_env_file=None), "esk-tests-session")
    try:
        jvm_pid = int(spark.sparkContext._jvm.ProcessHandle.current().pid())  # type: ignore[union-attr]
        frame = spark.range(1000).selectExpr("id", "id % 7 AS k")
        frame.persist().count()
        frame.unpersist(blocking=True)
        before = _live_sessions(jvm_pid)
        assert before >= 1
        for n in range(20):
            kept = spark.range(1000 + n).selectExpr("id", "id % 7 AS k").persist()
            assert kept.groupBy("k").count().count() == 7
            kept.unpersist(blocking=True)
        assert _live_sessions(jvm_pid) == before
    finally:
        spark.stop()


def test_spark_s_catalog_folder_is_made_in_the_warehouse_not_where_esk_runs(tmp_path: Path) -> None:
    """A container's working directory may be read-only: Spark's catalog folder (which esk's
    path-addressed tables leave empty) goes beside the tables."""
    settings = Settings(_env_file=None)
    warehouse = tmp_path / "warehouse"
    settings = settings.model_copy(update={"projections": settings.projections.model_copy(update={"warehouse_dir": warehouse})})
    spark = spark_session(settings, "esk-tests-catalog")
    try:
        assert [row[0] for row in spark.sql("SHOW DATABASES").collect()] == ["default"]  # the catalog, made
        assert spark.conf.get("spark.sql.warehouse.dir") == f"file:{warehouse / '_spark'}"
        assert (warehouse / "_spark").is_dir()
    finally:
        spark.stop()


DRIVER_LOGS = """
import os
from esk.logs import configure_logging
from esk.projections.session import spark_session
from esk.settings import Settings
settings = Settings(_env_file=None)
configure_logging(settings.log_level, settings.log_format)  # as esk's commands do
spark = spark_session(settings, "esk-tests-log-format")
spark.sparkContext._jvm.org.apache.logging.log4j.LogManager.getLogger("esk.tests").warn("one line from the driver")
spark.stop()
"""


@pytest.mark.parametrize("log_format", ["json", "text"])
def test_the_driver_s_log_lines_follow_the_log_format(log_format: str, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ESK_", "SPARK_CONF_DIR"))}
    env |= {"ESK_LOG_FORMAT": log_format, "ESK_PROJECTIONS__WAREHOUSE_DIR": str(tmp_path)}
    ran = subprocess.run([sys.executable, "-c", DRIVER_LOGS], env=env, capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    lines = [line for line in ran.stderr.splitlines() if line.strip()]
    ours = [line for line in lines if "one line from the driver" in line]
    assert len(ours) == 1, ran.stderr
    if log_format == "json":
        said = [json.loads(line) for line in lines]  # every line one JSON object
        [line] = [s for s in said if s["message"] == "one line from the driver"]
        assert (line["level"], line["logger"]) == ("WARN", "esk.tests") and line["timestamp"], line
        # the JVM's own notice of the incubator module Spark adds, written around log4j
        [notice] = [s for s in said if "Using incubator modules" in s["message"]]
        assert notice["logger"] == "esk.spark.driver", notice
    else:
        assert re.fullmatch(r"\d\d/\d\d/\d\d \d\d:\d\d:\d\d WARN tests: one line from the driver", ours[0]), ours
