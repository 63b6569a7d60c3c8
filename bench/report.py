"""Writes docs/benchmarks.md (machine, versions, table, ratios) and docs/benchmarks.png."""

from __future__ import annotations

import os
import platform
from datetime import UTC, datetime
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import TYPE_CHECKING

import psutil

from esk.jars import jars_dir

if TYPE_CHECKING:
    from bench.results import Report


def _version(package: str) -> str:
    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"


def _kafka_version() -> str:
    """The embedded broker's version, read off the jar its pom resolved."""
    jars = sorted(jars_dir("kafka").glob("kafka_2.13-*.jar"))
    return jars[0].name.removeprefix("kafka_2.13-").removesuffix(".jar") if jars else "unknown"


# Where the hand-kept part of benchmarks.md begins: the probes behind design choices, which
# a full run does not repeat, survive each `make bench`.
PROBES_HEADING = "## Probes behind design choices"


def write(report: Report, ratios: list[tuple[str, float | None, str]], docs: Path) -> None:
    chart = docs / "benchmarks.png"
    _chart(report, chart)
    lines = [
        "# Benchmarks",
        "",
        f"Written by `make bench` on {datetime.now(UTC):%Y-%m-%d %H:%M} UTC. Every figure comes from the "
        "same run on the same embedded broker; compare the ratios, not the absolute numbers, across machines.",
        "",
        "## Machine and versions",
        "",
        f"- {platform.platform()}, {os.cpu_count()} cores, {psutil.virtual_memory().total / 2**30:.0f} GiB",
        f"- Python {platform.python_version()}; Apache Kafka {_kafka_version()} (embedded, KRaft, one node)",
        "- " + ", ".join(f"{p} {_version(p)}" for p in ("aiokafka", "rocksdict", "confluent-kafka", "quixstreams")),
        "- " + ", ".join(f"{p} {_version(p)}" for p in ("fastapi", "uvicorn", "pyspark", "delta-spark", "deltalake")),
        "",
        f"## Results: {report.commands:,} commands over {report.accounts:,} accounts, {report.partitions} partitions",
        "",
        "| workload | system | value | unit | note |",
        "|---|---|---:|---|---|",
        *(f"| {r.workload} | {r.system} | {r.value:,.1f} | {r.unit} | {r.note} |" for r in report.rows),
        "",
        "## Against the targets",
        "",
        "| figure | measured | target |",
        "|---|---:|---|",
        *(f"| {name} | {'n/a' if value is None else f'{value:.2f}'} | {target} |" for name, value, target in ratios),
        "",
        "- C = ceilings (the clients and Kafka's own perf tools moving the same records with no processing).",
        "- W1 = processor throughput, W5 = resident memory (esk's processor and the Quix Streams peer).",
        "- W3 = restart and restore. 'Ready' is esk's own readiness (it owns every partition, restored). 'Outputs "
        "of new commands' is timed alike for esk and the Quix Streams peer: from the process's start until a few "
        "commands put on the topic just before it have their outputs written (read uncommitted, so neither "
        "system's commit cadence counts).",
        "- W2 = HTTP end to end: one API and one processor process, driven by a load generator process (a minimal "
        "HTTP/1.1 client on uvloop) that runs on the same 2 cores; each request waits for its command's outcome. The saturation rate is a "
        "closed loop; the latencies are an open loop at a fixed rate, counted from each request's scheduled "
        "instant (no coordinated omission); refused commands (insufficient funds, stale versions) are answers, "
        "not errors.",
        "- W6 = subscriptions, each `esk subscriber` its own process: the example's customer_ledger (a database "
        "handler, SQLite, exactly once) and payments (a reactor: commands and offsets in one Kafka transaction) "
        "catching up over the same order events as the read_committed consume ceiling, from their first committed "
        "progress; then their lag (records behind) under orders over HTTP at W2's fixed rate, and how long each takes "
        "to catch up once that load stops.",
        "- W4 = the customer_recent_orders projection (PySpark, local[2], into Delta Lake) over order events made by "
        "the processor: the catch-up rate of `esk project run`, and the lag of `--continuous` from a command's "
        "HTTP 200 to the Delta commit that shows its row.",
        "",
        f"![rates]({chart.name})",
        "",
    ]
    target = docs / "benchmarks.md"
    kept = target.read_text().partition(PROBES_HEADING)[2] if target.exists() else ""
    target.write_text("\n".join(lines) + (f"\n{PROBES_HEADING}{kept}" if kept else ""))


def _chart(report: Report, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in report.rows if r.unit in ("records/s", "commands/s", "events/s")]
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(rows) + 1))
    ax.barh([f"{r.workload} {r.system}" for r in rows], [r.value for r in rows],
            color=["#888" if r.workload == "C" else "#2a7" for r in rows])
    ax.invert_yaxis()
    ax.set_xscale("log")  # ceilings in the 100,000s and HTTP or Spark rates in the 1,000s, side by side
    ax.set_xlabel("per second (log scale)")
    ax.set_title(f"esk: {report.commands:,} commands")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
