"""The figures of one benchmark run, printed as they come in."""

from __future__ import annotations

from dataclasses import dataclass, field

from rich.console import Console

console = Console()


@dataclass
class Row:
    workload: str
    system: str
    value: float
    unit: str
    note: str = ""


@dataclass
class Report:
    commands: int
    accounts: int
    partitions: int
    rows: list[Row] = field(default_factory=list)

    def add(self, workload: str, system: str, value: float, unit: str, note: str = "") -> None:
        self.rows.append(Row(workload, system, value, unit, note))
        console.print(f"{workload:<4} {system:<38} {value:>12,.1f} {unit} {note}", highlight=False)

    def get(self, workload: str, system: str) -> float | None:
        return next((r.value for r in self.rows if r.workload == workload and r.system == system), None)
