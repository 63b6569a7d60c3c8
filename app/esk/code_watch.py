"""CodeWatch: which of the project's Python files changed, for `esk dev` to start its
processes again with them (as `uvicorn --reload` does a server)."""

from __future__ import annotations

import logging
import queue
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


def project_sources(settings: Settings, root: Path) -> list[Path]:
    """The packages (or modules) of the project under `root` that esk imports: those that
    ESK_DOMAIN, ESK_READ_MODELS and ESK_SUBSCRIPTIONS name, each by its top-level name, so
    that a module they import from their own package counts too. Not the whole of `root`,
    which may hold a virtual environment and esk's data."""
    found: list[Path] = []
    for spec in (settings.domain, settings.read_models, settings.subscriptions):
        top = spec.partition(":")[0].split(".")[0]
        for path in (root / top, root / f"{top}.py"):
            if top and path.exists() and path not in found:
                found.append(path)
    return found


class CodeWatch:
    """Notes the changes to Python files under `paths` in a thread of its own; `changed()`
    hands over those since its last call, without waiting."""

    def __init__(self, paths: Iterable[Path]) -> None:
        self.paths = list(paths)
        self._changed: queue.SimpleQueue[set[Path]] = queue.SimpleQueue()
        self._stop = threading.Event()
        packages = [path for path in self.paths if path.is_dir()]
        modules = {path for path in self.paths if not path.is_dir()}
        # A module is watched through its folder, not as a file: an editor that saves by
        # renaming a new file over the old one ends a watch on the old file. Not the
        # folder's subfolders, which may hold a virtual environment and esk's data.
        self._groups: list[tuple[list[Path], Callable[[Change, str], bool], bool]] = [
            (packages, PythonFilter(), True),
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
                self._changed.put({Path(path) for _, path in changes})
        except Exception as error:  # no watching (an OS limit on watches, say): esk dev goes on without it
            log.warning("not watching %s for changes (%r): start esk dev again after a change", ", ".join(map(str, paths)), error)
