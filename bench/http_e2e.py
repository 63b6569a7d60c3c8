"""W2, HTTP end to end: one `esk api` and one `esk processor`, driven over HTTP by the load
generator (bench/http_load.py, its own process) with the accounts workload of W1.

Accounts are opened first; then deposits and withdrawals over all of them, (a) closed loop
at a concurrency high enough to saturate the machine, (b) open loop at a fixed rate, where
latency counts from each request's scheduled instant. All of it shares the machine's
cores: the broker, the API, the processor and the generator; the saturation row says
how many cores each used, which shows where the ceiling is.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace
from pathlib import Path

from app.settings import Settings
from bench.cluster import Cluster, new_app
from bench.http_load import LoadSpec, run_load
from bench.measure import cpu_cores
from bench.results import Report

FIXED_RATE = 1_000  # commands/s: the rate the latency target is set at
SATURATION = "esk HTTP end to end, saturation"
P99 = f"esk HTTP latency p99 at {FIXED_RATE:,}/s"


@dataclass(frozen=True)
class W2Sizes:
    accounts: int
    saturation_s: float
    concurrency: int
    fixed_s: float


async def measure(base: Settings, workdir: Path, sizes: W2Sizes, budget_mb: int, broker_pid: int, report: Report) -> None:
    settings = await new_app(base, "w2")
    workdir = workdir / "w2"
    cluster = Cluster(settings, workdir)
    api = cluster.api("api")
    processor = cluster.processor("processor", ESK_PROCESSOR__MEMORY_BUDGET_MB=str(budget_mb))
    try:
        await asyncio.to_thread(cluster.start_all)
        load = LoadSpec(api.url, "open accounts", "opens", concurrency=64, accounts=sizes.accounts, seed=7)
        opens = await run_load(load, workdir)
        if opens.errors:
            raise RuntimeError(f"opening the accounts: {opens.describe_errors()}")

        load = replace(load, name="saturation", source="moves", concurrency=sizes.concurrency, duration_s=sizes.saturation_s)
        with cpu_cores({"broker": broker_pid, "api": api.pid, "processor": processor.pid}) as cores:
            saturation = await run_load(load, workdir)
        cores["generator"] = saturation.cpu_s / saturation.elapsed_s
        report.add("W2", SATURATION, saturation.rate, "commands/s",
                   f"closed loop, {sizes.concurrency} in flight, {sizes.saturation_s:.0f}s; {saturation.describe_errors()}; "
                   "cores used: " + ", ".join(f"{name} {used:.2f}" for name, used in cores.items()))

        load = replace(load, name="fixed rate", concurrency=0, rate=FIXED_RATE, duration_s=sizes.fixed_s)
        fixed = await run_load(load, workdir)
        for q, label in ((0.5, "p50"), (0.99, "p99"), (0.999, "p999")):
            report.add("W2", f"esk HTTP latency {label} at {FIXED_RATE:,}/s", fixed.latency_ms(q), "ms",
                       "open loop, from each request's scheduled instant" if label == "p50" else "")
        report.add("W2", f"esk HTTP achieved rate at {FIXED_RATE:,}/s", fixed.rate, "commands/s",
                   f"{len(fixed.statuses):,} requests due in {sizes.fixed_s:.0f}s; {fixed.describe_errors()}")
    finally:
        cluster.stop_all()
