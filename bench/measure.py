"""Measuring esk processes from outside: drain time, readiness, RSS, metric histograms, and
percentiles of measured samples."""

from __future__ import annotations

import asyncio
import math
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from aiokafka.errors import GroupCoordinatorNotAvailableError
import psutil
from prometheus_client.parser import text_string_to_metric_families

from app.settings import Settings
from bench.cluster import EskProcess
from bench.results import Report
from bench.workload import committed_lag


@dataclass
class Run:
    started: float
    ready_after_s: float | None = None
    drained_after_s: float | None = None
    rss_samples: list[int] = field(default_factory=list)

    @property
    def max_rss_mb(self) -> float:
        return max(self.rss_samples, default=0) / 2**20


async def drain(
    settings: Settings, process: EskProcess, group: str, topic: str, partitions: int, timeout_s: float
) -> Run:
    """Start `process` (already configured) and follow it until `group` has committed
    everything of `topic`; samples the process's RSS on the way."""
    run = Run(started=time.perf_counter())
    process.start()
    assert process.process is not None
    ps = psutil.Process(process.process.pid)
    deadline = run.started + timeout_s
    next_lag_check = 0.0
    while time.perf_counter() < deadline:
        await asyncio.sleep(0.25)
        try:
            run.rss_samples.append(ps.memory_info().rss)
        except psutil.NoSuchProcess:
            raise RuntimeError(f"{process.name} died; see {process.log_path}") from None
        now = time.perf_counter()
        if run.ready_after_s is None and process.metric("esk_active_tasks") == partitions:
            run.ready_after_s = now - run.started
        if now >= next_lag_check:
            next_lag_check = now + 0.5
            try:
                lag = await committed_lag(settings, group, topic)
            except GroupCoordinatorNotAvailableError:  # a young broker has no coordinator yet
                continue
            if lag == 0:
                run.drained_after_s = now - run.started
                return run
    raise TimeoutError(f"{process.name} did not drain {topic} in {timeout_s:.0f}s")


async def until_ready(process: EskProcess, partitions: int, timeout_s: float) -> float:
    """Start `process` and return the seconds until it owns every partition, restored."""
    started = time.perf_counter()
    process.start()
    while time.perf_counter() - started < timeout_s:
        if process.metric("esk_active_tasks") == partitions:
            return time.perf_counter() - started
        await asyncio.sleep(0.02)
    raise TimeoutError(f"{process.name} not ready in {timeout_s:.0f}s")


async def restarts(processor: EskProcess, partitions: int, aggregates: int, report: Report) -> None:
    """W3, on a stopped processor that has built its state: ready after a clean stop, then
    after losing its state directory (a full restore)."""
    ready = await until_ready(processor, partitions, 600)
    report.add("W3", "esk ready after clean stop", ready, "s", f"{aggregates:,} aggregates")
    processor.stop()
    shutil.rmtree(processor.env["ESK_PROCESSOR__STATE_DIR"])
    ready = await until_ready(processor, partitions, 3600)
    restored = processor.metric("esk_restore_records_total", role="processor") or 0
    report.add("W3", "esk ready after losing its state", ready, "s", f"{restored:,.0f} records restored")
    report.add("W3", "esk full restore rate", restored / ready, "records/s")
    processor.stop()


@contextmanager
def cpu_cores(pids: dict[str, int]) -> Iterator[dict[str, float]]:
    """The cores each process used (CPU seconds per second) while the block ran; the dict
    is filled in when the block ends."""

    def cpu(pid: int) -> float:
        times = psutil.Process(pid).cpu_times()
        return times.user + times.system

    before = {name: cpu(pid) for name, pid in pids.items()}
    started = time.perf_counter()
    cores: dict[str, float] = {}
    yield cores
    elapsed = time.perf_counter() - started
    cores.update({name: (cpu(pid) - before[name]) / elapsed for name, pid in pids.items()})


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank q-quantile (0 < q <= 1) of `values`; NaN when there are none."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def histogram_quantile(process: EskProcess, name: str, q: float) -> float | None:
    """A quantile from a Prometheus histogram's buckets (upper bound of the bucket)."""
    text = process.metrics_text()
    buckets: list[tuple[float, float]] = []
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == f"{name}_bucket":
                buckets.append((float(sample.labels["le"]), sample.value))
    if not buckets:
        return None
    buckets.sort()
    total = buckets[-1][1]
    for bound, count in buckets:
        if count >= q * total:
            return bound
    return None
