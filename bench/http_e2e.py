"""W2, HTTP end to end: one `esk api` and one `esk processor`, driven over HTTP by the load
generator (bench/http_load.py, its own process) with the accounts workload of W1.

Accounts are opened first; then deposits and withdrawals over all of them, (a) closed loop
at a concurrency high enough to saturate the machine, (b) open loop at fixed rates (half
the saturation rate, and the target's 1,000/s), where latency counts from each request's
scheduled instant. All of it shares the machine's
cores: the broker, the API, the processor and the generator; the saturation row says
how many cores each used, which shows where the ceiling is.
"""

from __future__ import annotations

import asyncio
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from bench.cluster import Cluster, new_app, run_harness, scratch_broker, scratch_settings, workload_arguments
from bench.http_load import LoadSpec, run_load
from bench.measure import cpu_cores
from bench.results import Report, console
from esk.settings import Settings

FIXED_RATE = 1_000  # commands/s: the rate the latency target is set at
SATURATION = "esk HTTP end to end, saturation"


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

        # Half the saturation rate (the latency of a system that keeps up), then the target's
        # rate, which may leave a backlog behind: last.
        for rate in (max(10, round(saturation.rate / 2, -1)), FIXED_RATE):
            await _open_loop(replace(load, name=f"fixed rate {rate:.0f}", concurrency=0, rate=rate, duration_s=sizes.fixed_s),
                             workdir, report)
    finally:
        cluster.stop_all()


async def _open_loop(load: LoadSpec, workdir: Path, report: Report) -> None:
    fixed = await run_load(load, workdir)
    for q, label in ((0.5, "p50"), (0.99, "p99"), (0.999, "p999")):
        report.add("W2", latency_row(label, load.rate), fixed.latency_ms(q), "ms",
                   "open loop, from each request's scheduled instant" if label == "p50" else "")
    behind = "; more than the system sustains: the queue grew for the whole run" if fixed.rate < 0.95 * load.rate else ""
    report.add("W2", f"esk HTTP achieved rate at {load.rate:,.0f}/s", fixed.rate, "commands/s",
               f"{len(fixed.statuses):,} requests due in {load.duration_s:.0f}s; {fixed.describe_errors()}{behind}")


QUICK = W2Sizes(accounts=5_000, saturation_s=15, concurrency=256, fixed_s=20)
FULL = W2Sizes(accounts=20_000, saturation_s=60, concurrency=256, fixed_s=60)


def latency_row(label: str, rate: float) -> str:
    return f"esk HTTP latency {label} at {rate:,.0f}/s"


async def run(sizes: W2Sizes, partitions: int, budget_mb: int) -> Report:
    """W2 alone, on a scratch broker of its own."""
    async with scratch_broker("esk-w2") as broker:
        pid = broker.pid()
        assert pid is not None
        report = Report(0, sizes.accounts, partitions)
        workdir = Path(tempfile.mkdtemp(prefix="esk-w2-"))
        console.print(f"broker on {broker.bootstrap}; work in {workdir}")
        await measure(scratch_settings(broker, "w2", partitions), workdir, sizes, budget_mb, pid, report)
        return report


def main() -> None:
    args = workload_arguments(__doc__)
    run_harness(run(QUICK if args.quick else FULL, args.partitions, args.budget_mb))


if __name__ == "__main__":
    main()
