"""Measuring esk processes from outside: drain time, readiness, RSS, metric histograms, and
percentiles of measured samples."""

from __future__ import annotations

import asyncio
import math
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import psutil
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import GroupCoordinatorNotAvailableError
from prometheus_client.parser import text_string_to_metric_families

from bench.cluster import EskProcess
from bench.results import Report
from bench.workload import PROBES, committed_lag, probe_records, produce
from esk.kafka.client_options import client_options
from esk.kafka.metadata import topic_partitions
from esk.kafka.topics import TopicNames
from esk.settings import Settings


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


class OutputWatch:
    """Counts the records written to `topic` from the moment it is entered, read uncommitted:
    what a process has produced, whatever its commit cadence."""

    def __init__(self, settings: Settings, topic: str) -> None:
        self._settings, self._topic = settings, topic

    async def __aenter__(self) -> OutputWatch:
        self._consumer = AIOKafkaConsumer(**client_options(self._settings), group_id=None, enable_auto_commit=False)
        await self._consumer.start()
        tps = [TopicPartition(self._topic, p) for p in await topic_partitions(self._settings, self._topic)]
        self._consumer.assign(tps)
        for tp, end in (await self._consumer.end_offsets(tps)).items():
            self._consumer.seek(tp, end)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._consumer.stop()

    async def poll(self, timeout_s: float) -> int:
        """The records seen within `timeout_s`."""
        batches = await self._consumer.getmany(timeout_ms=int(timeout_s * 1000))
        return sum(len(batch) for batch in batches.values())


@dataclass
class Restart:
    outputs_s: float  # from start until every probe command's output is written
    ready_s: float | None  # until `ready` held (esk: it owns every partition, restored)


async def restart(
    settings: Settings,
    start: Callable[[], object],
    commands: str,
    outputs: str,
    probes: list[tuple[bytes, bytes]],
    timeout_s: float,
    ready: Callable[[], bool] | None = None,
) -> Restart:
    """W3 for any system: put `probes` (one output each) on `commands`, call `start`, and
    time it until their outputs are on `outputs` (and until `ready`, when given)."""
    async with OutputWatch(settings, outputs) as watch:
        await produce(settings, commands, probes)
        started = time.perf_counter()
        start()
        outputs_s = ready_s = None
        seen = 0
        while outputs_s is None or (ready is not None and ready_s is None):
            elapsed = time.perf_counter() - started
            if elapsed > timeout_s:
                raise TimeoutError(f"{seen} of {len(probes)} outputs on {outputs} after {timeout_s:.0f}s")
            if ready is not None and ready_s is None and ready():
                ready_s = elapsed
            seen += await watch.poll(0.02)
            if outputs_s is None and seen >= len(probes):
                outputs_s = time.perf_counter() - started
        assert outputs_s is not None
        return Restart(outputs_s, ready_s)


async def restarts(settings: Settings, processor: EskProcess, partitions: int, aggregates: list[str], report: Report) -> None:
    """W3, on a stopped processor that has built its state over `aggregates` (accounts):
    restarted after a clean stop, then after losing its state directory (a full restore)."""
    names = TopicNames(settings.app)

    async def timed(after: str) -> Restart:
        return await restart(settings, processor.start, names.commands, names.results, probe_records(aggregates, after), 3600,
                             ready=lambda: processor.metric("esk_active_tasks") == partitions)

    clean = await timed("clean stop")
    assert clean.ready_s is not None
    report.add("W3", "esk ready after clean stop", clean.ready_s, "s", f"{len(aggregates):,} aggregates")
    report.add("W3", w3_outputs_row("esk", "clean stop"), clean.outputs_s, "s", f"{PROBES} new commands")
    processor.stop()
    shutil.rmtree(processor.env["ESK_PROCESSOR__STATE_DIR"])
    lost = await timed("lost state")
    restored = processor.metric("esk_restore_records_total", role="processor") or 0
    assert lost.ready_s is not None
    report.add("W3", "esk ready after losing its state", lost.ready_s, "s", f"{restored:,.0f} records restored")
    report.add("W3", w3_outputs_row("esk", "lost state"), lost.outputs_s, "s", f"{PROBES} new commands")
    report.add("W3", "esk full restore rate", restored / lost.ready_s, "records/s")
    processor.stop()

    # A release that changed the accounts state model: every account is rebuilt from its events.
    domain = processor.env["ESK_DOMAIN"]
    processor.env["ESK_DOMAIN"] = "bench.changed_domain:AGGREGATES"
    try:
        changed = await timed("changed state model")
        rebuilt = processor.metric("esk_rebuild_events_total") or 0
        assert changed.ready_s is not None
        report.add("W3", "esk ready after the state model changed", changed.ready_s, "s",
                   f"{processor.metric('esk_rebuilt_aggregates_total') or 0:,.0f} states rebuilt from {rebuilt:,.0f} events")
        report.add("W3", REBUILD_RATE, rebuilt / changed.ready_s, "events/s")
    finally:
        processor.stop()
        processor.env["ESK_DOMAIN"] = domain


REBUILD_RATE = "esk rebuild rate after a state model changed"


def w3_outputs_row(system: str, after: str) -> str:
    return f"{system} outputs of new commands after {after}"


@contextmanager
def cpu_cores(pids: dict[str, int]) -> Iterator[dict[str, float]]:
    """The cores each process used (CPU seconds per second) while the block ran; the dict
    is filled in when the block ends."""

    def cpu(pid: int) -> float:
        times = psutil.Process(pid).cpu_times()
        return float(times.user + times.system)

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
