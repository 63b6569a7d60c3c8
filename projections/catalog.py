"""The read models and where their Delta tables live. Imports no Spark.

A table has generations: `<warehouse>/<name>/g<N>`, and the file `<warehouse>/<name>/CURRENT`
names the one readers use. `--rebuild` builds generation N+1 from the earliest offsets and
only then replaces CURRENT (atomically), so a reader never sees a half-built read model.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ReadModel:
    name: str
    categories: tuple[str, ...]  # aggregate types whose event streams it reads
    description: str
    order_by: tuple[str, ...] = ()  # how readers get rows ("-col" = descending)
    partition_by: tuple[str, ...] = ()


CATALOG: dict[str, ReadModel] = {
    m.name: m
    for m in (
        ReadModel(
            "customer_recent_orders",
            ("orders",),
            "each customer's last 30 orders, newest first",
            order_by=("customer_id", "-placed_at", "-order_id"),
        ),
        ReadModel("account_balances", ("accounts",), "balance, status and version per account", order_by=("account_id",)),
        ReadModel("daily_order_totals", ("orders",), "orders placed and amount per day", order_by=("day",)),
        ReadModel(
            "events_archive",
            ("accounts", "orders"),
            "every event, partitioned by aggregate type and day",
            order_by=("aggregate_type", "aggregate_id", "version"),
            partition_by=("aggregate_type", "day"),
        ),
    )
}


class Tables:
    def __init__(self, warehouse: Path) -> None:
        self.warehouse = Path(warehouse)

    def current_generation(self, name: str) -> int | None:
        try:
            return int((self.warehouse / name / "CURRENT").read_text().strip().lstrip("g"))
        except (FileNotFoundError, ValueError):
            return None

    def path(self, name: str, generation: int) -> Path:
        return self.warehouse / name / f"g{generation}"

    def current_path(self, name: str) -> Path | None:
        generation = self.current_generation(name)
        return None if generation is None else self.path(name, generation)

    def checkpoint(self, name: str, generation: int) -> Path:
        return self.warehouse / "_checkpoints" / name / f"g{generation}"

    def switch(self, name: str, generation: int) -> None:
        """Point readers at `generation`: a rename, so they see the old or the new, never neither."""
        pointer = self.warehouse / name / "CURRENT"
        pointer.parent.mkdir(parents=True, exist_ok=True)
        staged = pointer.with_suffix(".next")
        staged.write_text(f"g{generation}\n")
        os.replace(staged, pointer)
