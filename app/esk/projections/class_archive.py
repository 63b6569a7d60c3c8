"""Class data sharing for the local Spark driver: its JVM maps the classes of Spark, Delta
and their dependencies from an archive instead of loading and verifying them from the
jars, which is much of a short run's time (`esk project run` over a few events, `esk sql`;
docs/benchmarks.md).

The archive is made once per Java and set of jars, by a Spark session of its own that
writes it as its JVM exits (`-XX:ArchiveClassesAtExit`). It is taken into use only after
that JVM has exited cleanly: a JVM that maps a partly written archive dies (SIGBUS), so an
archive is written under a name of its own and renamed into place afterwards. `esk jars
spark` (and so `make setup`) makes it; a session that finds none runs without.

That session is `esk.projections.archive_maker`.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from ..jars import cache_dir
from ..processes import alive

TIMEOUT_S = 600


def archive_path(jars: Sequence[Path]) -> Path:
    """Where the archive of this Java and these jars lives: an archive records the JVM it
    was made by and each jar of the class path (pyspark's and esk's) by its size and time,
    and a JVM whose Java or jars differ cannot map it (a venv made again at the same path
    has pyspark's jars of other times; their names carry Spark's version)."""
    shipped = sorted((Path(_pyspark_home()) / "jars").glob("*.jar"))
    digest = hashlib.sha256()
    for part in (_java_identity(), *map(_file_identity, [*shipped, *jars])):
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
    archive.parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned(archive)
    owner, home = _owner_file(archive), _pyspark_home()
    if archive.exists():
        if not owner.exists():  # made before owners were recorded
            owner.write_text(home)
        return archive
    _remove_stale(archive, home)
    partial = archive.with_name(f"{archive.stem}.{os.getpid()}.partial")
    try:
        # A session of its own: on a timeout its JVM goes down with it, before it writes.
        with subprocess.Popen(
            [sys.executable, "-m", "esk.projections.archive_maker", str(partial)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        ) as maker:
            try:
                output, _ = maker.communicate(timeout=TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(maker.pid, signal.SIGKILL)
                maker.communicate()
                raise RuntimeError(f"the session that makes the class archive took more than {TIMEOUT_S}s") from None
        if maker.returncode != 0 or not partial.exists():
            tail = "\n".join(output.strip().splitlines()[-5:])
            raise RuntimeError(f"the session that makes the class archive failed (exit {maker.returncode}): {tail}")
        os.replace(partial, archive)
        owner.write_text(home)
    except OSError as error:
        raise RuntimeError(f"could not make the class archive: {error}") from None
    finally:
        partial.unlink(missing_ok=True)
    return archive


def _remove_abandoned(archive: Path) -> None:
    """Partial archives whose process is gone (killed while making one)."""
    for partial in archive.parent.glob(f"{archive.stem}.*.partial"):
        pid = partial.suffixes[-2].lstrip(".")
        if pid.isdigit() and not alive(int(pid)):
            partial.unlink(missing_ok=True)


def _remove_stale(archive: Path, owner: str) -> None:
    """The archives made for `owner` (a pyspark's folder) under another key, and those made
    for a pyspark that is gone. (A JVM that maps one goes on with it: the file's data stays
    until the JVM unmaps it.) An archive whose owner is not recorded is left."""
    for other in archive.parent.glob("spark-*.jsa"):
        recorded = _owner_file(other)
        try:
            theirs = recorded.read_text().strip()
        except OSError:
            continue
        if other != archive and (theirs == owner or not Path(theirs).is_dir()):
            other.unlink(missing_ok=True)
            recorded.unlink(missing_ok=True)


def _owner_file(archive: Path) -> Path:
    return archive.with_suffix(".owner")


def _pyspark_home() -> str:
    import pyspark

    return str(Path(pyspark.__file__).parent)


def _file_identity(path: Path) -> str:
    try:
        stat = path.stat()
    except OSError:
        return str(path)
    return f"{path}:{stat.st_size}:{stat.st_mtime_ns}"


def _java_identity() -> str:
    """The Java pyspark starts (JAVA_HOME's, else the first on PATH), and its build."""
    home = os.environ.get("JAVA_HOME")
    java = Path(home, "bin", "java") if home else Path(shutil.which("java") or "java")
    with contextlib.suppress(OSError):
        java = java.resolve()
        return f"{java}:{java.stat().st_mtime_ns}"
    return str(java)
