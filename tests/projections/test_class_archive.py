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
    # pyspark's own jars count as well: a venv made again in place has them of other times.
    home = tmp_path / "venv" / "pyspark"
    (home / "jars").mkdir(parents=True)
    shipped = home / "jars" / "spark-core.jar"
    shipped.write_bytes(b"classes")
    with monkeypatch.context() as patched:
        patched.setattr(class_archive, "_pyspark_home", lambda: str(home))
        installed = class_archive.archive_path(jars)
        os.utime(shipped, ns=(0, 0))
        assert class_archive.archive_path(jars) != installed
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


def test_making_an_archive_removes_those_no_session_maps_again(tmp_path: Path) -> None:
    folder = tmp_path / "class-archives"
    folder.mkdir()
    mine, gone = tmp_path / "venv" / "pyspark", tmp_path / "removed-venv" / "pyspark"
    mine.mkdir(parents=True)
    other = tmp_path / "other-venv" / "pyspark"
    other.mkdir(parents=True)

    def archive(name: str, owner: Path | None) -> Path:
        path = folder / f"spark-{name}.jsa"
        path.write_bytes(b"classes")
        if owner is not None:
            path.with_suffix(".owner").write_text(str(owner))
        return path

    current = archive("current", mine)
    replaced = archive("replaced", mine)  # the same pyspark, since with another Java or jars
    orphaned = archive("orphaned", gone)
    elsewhere = archive("elsewhere", other)
    unrecorded = archive("unrecorded", None)
    class_archive._remove_stale(current, str(mine))
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        [current.name, current.with_suffix(".owner").name, elsewhere.name, elsewhere.with_suffix(".owner").name, unrecorded.name]
    )
    assert not replaced.exists() and not orphaned.exists()


def test_a_session_shares_the_archive_s_classes() -> None:
    archive = class_archive.make_archive(extra_jars(None))  # made by `make setup`, else now
    probe = "from esk.projections.session import spark_session; from esk.settings import Settings; " \
            "print('count=%d' % spark_session(Settings(_env_file=None), 'esk-probe').range(5).count())"
    # -Xshare:on fails rather than run without; the JDK's own archive would satisfy it, so
    # the classes' log says which archive each came from: "(top)" is esk's, on top of it.
    env = {**os.environ, "ESK_PROJECTIONS__DRIVER_JAVA_OPTIONS": "-Xshare:on -Xlog:class+load=info"}
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "count=5" in done.stdout  # among the JVM's class-load lines, which share the pipe
    from_esk = [line for line in done.stdout.splitlines() if "source: shared objects file (top)" in line]
    assert any("org.apache.spark.sql.delta" in line for line in from_esk), "no Delta class came from esk's archive"
    assert archive.stat().st_size > 10_000_000
    assert archive.with_suffix(".owner").read_text() == class_archive._pyspark_home()


def test_a_session_that_fails_or_takes_too_long_leaves_no_archive(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    jars = extra_jars(None)
    monkeypatch.setenv("ESK_PROJECTIONS__JARS_DIR", str(jars[0].parent))  # the cache's, not resolved again
    monkeypatch.setenv("ESK_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("ESK_PROJECTIONS__DRIVER_JAVA_OPTIONS", "-Xmx1m")  # Spark refuses a heap size here
    with pytest.raises(RuntimeError, match="failed"):
        class_archive.make_archive(jars)
    monkeypatch.delenv("ESK_PROJECTIONS__DRIVER_JAVA_OPTIONS")
    monkeypatch.setattr(class_archive, "TIMEOUT_S", 1)
    with pytest.raises(RuntimeError, match="took more than 1s"):
        class_archive.make_archive(jars)
    assert list((tmp_path / "class-archives").iterdir()) == []


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid
