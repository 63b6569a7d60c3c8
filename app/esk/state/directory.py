"""StateDirectory: where a processor keeps the store of each commands partition."""

from __future__ import annotations

from pathlib import Path


class StateDirectory:
    def __init__(self, root: Path, commands_topic: str) -> None:
        self.root = Path(root)
        self._prefix = f"{commands_topic}-"

    def store_path(self, partition: int) -> Path:
        return self.root / f"{self._prefix}{partition}"

    def partitions_on_disk(self) -> set[int]:
        """The partitions that have a store here, whatever state it is in."""
        if not self.root.is_dir():
            return set()
        names = (path.name[len(self._prefix):] for path in self.root.iterdir() if path.name.startswith(self._prefix))
        return {int(name) for name in names if name.isdigit()}
