"""The Java jars esk needs, resolved from Maven Central on first use into a cache outside
the installed package, so that an esk installed from a wheel needs no checkout.

Two sets, each described by a pom that travels with the package (`jars/<set>/pom.xml`):
`kafka` (the embedded broker and its perf tools) and `spark` (Spark's Kafka source and
Delta Lake). A set lives in `<cache>/<set>-<digest of its Maven files>`, so a changed pom
resolves afresh and never mixes with jars of the old one. The cache is `ESK_CACHE_DIR`,
else `$XDG_CACHE_HOME/esk`, else `~/.cache/esk`. Resolving needs Maven (`mvn`).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from importlib import resources
from pathlib import Path

JAR_SETS = ("kafka", "spark")
_DONE = ".resolved"


class JarsError(RuntimeError):
    """A one-line, actionable reason why a jar set cannot be resolved."""


# Not a setting: read where no Settings are at hand (the class archive's path).
CACHE_DIR_VARIABLE = "ESK_CACHE_DIR"


def cache_dir() -> Path:
    explicit = os.environ.get(CACHE_DIR_VARIABLE)
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "esk"


def jars_dir(jar_set: str, configured: Path | None = None) -> Path:
    """The directory of `jar_set`'s jars: `configured` when given (an image that ships
    them), else the cache, resolved there first if it is not yet."""
    if configured is not None:
        return Path(configured)
    target = cache_dir() / f"{jar_set}-{_digest(jar_set)}"
    if not (target / _DONE).exists():
        _resolve(jar_set, target)
    return target


def _maven_files(jar_set: str) -> dict[str, bytes]:
    if jar_set not in JAR_SETS:
        raise JarsError(f"no jar set {jar_set!r}; there are {', '.join(JAR_SETS)}")
    folder = resources.files(__package__).joinpath(jar_set)
    return {entry.name: entry.read_bytes() for entry in folder.iterdir() if entry.name.endswith(".xml")}


def _digest(jar_set: str) -> str:
    digest = hashlib.sha256()
    for name, content in sorted(_maven_files(jar_set).items()):
        digest.update(name.encode() + b"\0" + content)
    return digest.hexdigest()[:12]


def _resolve(jar_set: str, target: Path) -> None:
    mvn = shutil.which("mvn")
    if mvn is None:
        raise JarsError(
            f"the {jar_set} jars are not in {target.parent} yet and Maven is needed to fetch them: "
            "install it (apt-get install maven), or set the jars directory in the settings"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    # Resolved beside the target and renamed into place: two processes resolving at once
    # never see (or leave) half a set.
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{jar_set}-") as scratch:
        work = Path(scratch)
        for name, content in _maven_files(jar_set).items():
            (work / name).write_bytes(content)
        command = [mvn, "-q", "-B", "-f", str(work / "pom.xml"), "dependency:copy-dependencies"]
        if (work / "maven-settings.xml").exists():
            command[1:1] = ["-s", str(work / "maven-settings.xml")]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            tail = "\n".join((result.stdout + result.stderr).strip().splitlines()[-15:])
            raise JarsError(f"Maven could not resolve the {jar_set} jars:\n{tail}")
        (work / "jars" / _DONE).touch()
        try:
            os.replace(work / "jars", target)
        except OSError:
            if not (target / _DONE).exists():  # not another process's finished copy
                raise
