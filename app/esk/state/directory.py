"""StateDirectory: where a processor keeps the store of each commands partition, and when
the store of a partition it no longer keeps goes."""

from __future__ import annotations

import fcntl
import os
import shutil
import uuid
from collections.abc import Collection, Iterable
from pathlib import Path

from .store import checkpointed_offsets, open_here

# What a store is renamed to on its way out: no longer a partition's store from then on.
SET_ASIDE = ".removing-"


class StateDirectory:
    def __init__(self, root: Path, commands_topic: str) -> None:
        self.root = Path(root)
        self._prefix = f"{commands_topic}-"
        self._unused_since: dict[int, float] = {}

    def store_path(self, partition: int) -> Path:
        return self.root / f"{self._prefix}{partition}"

    def partitions_on_disk(self) -> set[int]:
        """The partitions that have a store here, whatever state it is in."""
        if not self.root.is_dir():
            return set()
        names = (path.name[len(self._prefix):] for path in self.root.iterdir() if path.name.startswith(self._prefix))
        return {int(name) for name in names if name.isdigit()}

    def copies_on_disk(self) -> dict[int, int]:
        """partition -> the changelog offset its store on disk held at its last clean close
        (0 when that is not known: one never closed cleanly, or of an older esk)."""
        return {p: checkpointed_offsets(self.store_path(p)).get(p, 0) for p in self.partitions_on_disk()}

    def set_aside_unused(self, in_use: Collection[int], delay_s: float, now: float) -> dict[int, Path]:
        """Renames out of the way the stores of the partitions that were not `in_use` at
        any call during the last `delay_s` (each call's `now`, in seconds), and returns
        where each went, to be deleted (`delete`). Until then a store given up stays, for
        a takeover to find it warm; after that it only takes disk. A store that this process
        or another has open stays."""
        unused = self.partitions_on_disk() - set(in_use)
        self._unused_since = {partition: self._unused_since.get(partition, now) for partition in unused}
        aside: dict[int, Path] = {}
        for partition, since in sorted(self._unused_since.items()):
            if now - since >= delay_s and (moved := self._set_aside(partition)) is not None:
                aside[partition] = moved
                del self._unused_since[partition]
        return aside

    def set_aside_earlier(self) -> list[Path]:
        """Stores set aside whose deletion a stop or a crash cut short."""
        return sorted(self.root.glob(f"{SET_ASIDE}*")) if self.root.is_dir() else []

    @staticmethod
    def delete(paths: Iterable[Path]) -> None:
        for path in paths:
            shutil.rmtree(path, ignore_errors=True)

    def mark_used(self, partitions: Collection[int]) -> None:
        """Partitions in use since the last look (given to this process, even briefly): their
        wait starts over."""
        for partition in partitions:
            self._unused_since.pop(partition, None)

    def _set_aside(self, partition: int) -> Path | None:
        path = self.store_path(partition)
        if open_here(path):
            return None  # whatever the caller thought: a lock test on it would drop RocksDB's
        try:
            # RocksDB's own lock on its LOCK file (a POSIX record lock): held by whoever has
            # the store open. Only ever taken here on a store this process does not have
            # open (above): closing the file would drop a lock of this process's own on it.
            fd = os.open(path / "LOCK", os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:
            fd = None  # not a RocksDB store (yet): nothing has it open
        try:
            if fd is not None:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            aside = self.root / f"{SET_ASIDE}{path.name}-{uuid.uuid4().hex[:8]}"
            path.rename(aside)
            return aside
        except OSError:  # held open by another process, or gone
            return None
        finally:
            if fd is not None:
                os.close(fd)
