"""CodeWatch: which of the project's Python files changed, for `esk dev` to start its
processes again with them (as `uvicorn --reload` does a server)."""

from __future__ import annotations

import hashlib
import logging
import queue
import sys
import sysconfig
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

from watchfiles import Change, PythonFilter, watch

from .settings import Settings

log = logging.getLogger(__name__)
# Its "1 change detected" at INFO would come before esk's own line naming the files.
logging.getLogger("watchfiles").setLevel(logging.WARNING)

# Long enough that an editor's save (a temporary file, a rename, a second write) is one
# change, short enough that a saved file is running well before the user's next request.
DEBOUNCE_MS = 400


def project_sources(settings: Settings, root: Path, imported: Iterable[Path] = ()) -> list[Path]:
    """The packages (or modules) of the project under `root` that esk imports: those that
    ESK_DOMAIN, ESK_READ_MODELS and ESK_SUBSCRIPTIONS name, and those of the `imported`
    files (a helper module of the project that they import), each by its top-level name,
    so that a module they import from their own package counts too. Not the whole of
    `root`, which may hold a virtual environment and esk's data."""
    tops = [spec.partition(":")[0].split(".")[0] for spec in (settings.domain, settings.read_models, settings.subscriptions)]
    interpreter = {sys.prefix, sys.base_prefix, sys.exec_prefix, *sysconfig.get_paths().values()}
    for path in imported:
        if _projects_own(path, root, interpreter):
            inside = path.relative_to(root).parts
            tops.append(inside[0] if len(inside) > 1 else path.stem)
    found: list[Path] = []
    for top in tops:
        for path in (root / top, root / f"{top}.py"):
            if top and path.exists() and path not in found:
                found.append(path)
    return found


def imported_files() -> list[Path]:
    """The files of the modules this process has imported."""
    return [Path(file) for module in list(sys.modules.values()) if isinstance(file := getattr(module, "__file__", None), str)]


def _projects_own(path: Path, root: Path, interpreter: set[str]) -> bool:
    """A file of the project's own code under `root`: not of a virtual environment or esk's
    data (a hidden folder), of an installed package, or of Python's own library (under one
    of the `interpreter`'s folders: the folder esk runs in may hold a Python, or be `/`)."""
    if not path.is_relative_to(root) or any(path.is_relative_to(folder) for folder in interpreter):
        return False
    parts = path.relative_to(root).parts
    return not (parts[0].startswith(".") or "site-packages" in parts or "dist-packages" in parts)


class CodeWatch:
    """Notes the changes to Python files under `paths` in a thread of its own; `changed()`
    hands over those since its last call, without waiting. A file saved as it was (an
    editor's save without an edit, a `touch`) is no change."""

    def __init__(self, paths: Iterable[Path]) -> None:
        self.paths = list(paths)
        self._changed: queue.SimpleQueue[set[Path]] = queue.SimpleQueue()
        self._stop = threading.Event()
        packages = [path for path in self.paths if path.is_dir()]
        modules = {path for path in self.paths if not path.is_dir()}
        python = PythonFilter()
        self._digests = {
            path: digest
            for path in [*modules, *(file for package in packages for file in package.rglob("*") if python(Change.modified, str(file)))]
            if (digest := _digest(path)) is not None
        }
        self._digests_lock = threading.Lock()
        # A module is watched through its folder, not as a file: an editor that saves by
        # renaming a new file over the old one ends a watch on the old file. Not the
        # folder's subfolders, which may hold a virtual environment and esk's data.
        self._groups: list[tuple[list[Path], Callable[[Change, str], bool], bool]] = [
            (packages, python, True),
            (sorted({module.parent for module in modules}), lambda _, path: Path(path) in modules, False),
        ]

    def start(self) -> CodeWatch:
        for group in self._groups:
            if group[0]:
                threading.Thread(target=self._watch, args=group, name="code-watch", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def changed(self) -> set[Path]:
        paths: set[Path] = set()
        while not self._changed.empty():
            paths |= self._changed.get_nowait()
        return paths

    def _watch(self, paths: list[Path], only: Callable[[Change, str], bool], recursive: bool) -> None:
        try:
            for changes in watch(
                *paths, watch_filter=only, recursive=recursive, debounce=DEBOUNCE_MS, stop_event=self._stop, raise_interrupt=False
            ):
                if changed := {path for path in {Path(path) for _, path in changes} if self._content_changed(path)}:
                    self._changed.put(changed)
        except Exception as error:  # no watching (an OS limit on watches, say): esk dev goes on without it
            log.warning("not watching %s for changes (%r): start esk dev again after a change", ", ".join(map(str, paths)), error)

    def _content_changed(self, path: Path) -> bool:
        digest = _digest(path)
        with self._digests_lock:
            if self._digests.get(path) == digest:
                return False
            if digest is None:
                del self._digests[path]
            else:
                self._digests[path] = digest
            return True


def _digest(path: Path) -> bytes | None:
    """The file's content, digested; None when there is no such file (or none to read)."""
    try:
        return hashlib.blake2b(path.read_bytes(), digest_size=16).digest()
    except OSError:
        return None
