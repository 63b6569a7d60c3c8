"""The local driver's class archive: one per Java and set of jars, used only once whole,
and a JVM that must share classes from it (-Xshare:on, which fails rather than run
without) starts a session and runs a query."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("pyspark")

from esk.projections import class_archive
from esk.projections.session import extra_jars

pytestmark = pytest.mark.spark


def test_an_archive_is_keyed_by_its_jars_and_used_only_once_in_place(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ESK_CACHE_DIR", str(tmp_path))
    jars = [tmp_path / "a.jar", tmp_path / "b.jar"]
    archive = class_archive.archive_path(jars)
    assert archive.parent == tmp_path / "class-archives"
    assert class_archive.archive_path(jars[:1]) != archive  # another class path, another archive
    assert class_archive.sharing_options(jars) == []
    archive.parent.mkdir()
    # Partial archives are never mapped: a killed maker's is removed, a live one's kept.
    abandoned = archive.with_name(f"{archive.stem}.{_dead_pid()}.partial")
    making = archive.with_name(f"{archive.stem}.{os.getpid()}.partial")
    abandoned.write_bytes(b"half")
    making.write_bytes(b"half")
    assert class_archive.sharing_options(jars) == []
    class_archive._remove_abandoned(archive)
    assert not abandoned.exists() and making.exists()
    archive.write_bytes(b"whole")
    assert class_archive.sharing_options(jars) == [f"-XX:SharedArchiveFile={archive}"]


def test_a_session_shares_the_archive_s_classes() -> None:
    archive = class_archive.make_archive(extra_jars(None))  # made by `make setup`, else now
    probe = "from esk.projections.session import spark_session; from esk.settings import Settings; " \
            "print(spark_session(Settings(_env_file=None), 'esk-probe').range(5).count())"
    env = {**os.environ, "ESK_PROJECTIONS__DRIVER_JAVA_OPTIONS": "-Xshare:on"}
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "5"
    assert archive.stat().st_size > 10_000_000  # Spark's classes, not a stub


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid
