"""When rows first became visible in a Delta table, read the way the API reads read models
(delta-rs, no JVM): the commit time of the first table version that holds each row."""

from __future__ import annotations

from pathlib import Path


class RowWatch:
    """Follows a Delta table version by version; remembers, for every row whose `column`
    starts with `prefix`, the commit time (epoch seconds) of the version it appeared in."""

    def __init__(self, path: Path, column: str, prefix: str) -> None:
        from deltalake import DeltaTable

        self.path, self.column, self.prefix = path, column, prefix
        self.version = DeltaTable(str(path)).version()  # rows already there are not new
        self.first_seen: dict[str, float] = {}

    def poll(self) -> None:
        import pyarrow.compute as pc
        from deltalake import DeltaTable

        table = DeltaTable(str(self.path))
        latest = table.version()
        if latest == self.version:
            return
        committed = {entry["version"]: entry["timestamp"] / 1000 for entry in table.history(latest - self.version)}
        matching = pc.starts_with(pc.field(self.column), pattern=self.prefix)
        for version in range(self.version + 1, latest + 1):
            # Each version in turn: a row counts from the commit that made it visible, even
            # when a later commit (the trim of the same batch) landed before this poll.
            table.load_as_version(version)
            rows = table.to_pyarrow_dataset().to_table(columns=[self.column], filter=matching)
            for value in rows.column(self.column).to_pylist():
                self.first_seen.setdefault(value, committed[version])
        self.version = latest
