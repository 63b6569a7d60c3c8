"""Runs the Quix Streams peer (bench/quix_app.py) as a child process on the same commands
topic as esk: W1 (drain it) and W3 (restart it, with its state and without)."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from bench.measure import restart, w3_outputs_row
from bench.results import Report
from bench.workload import PROBES, committed_lag, end_offsets, probe_records
from esk.kafka.topics import TopicSpec, ensure_topics
from esk.settings import Settings

SYSTEM = "Quix Streams"
W1_ROW = f"{SYSTEM} peer"  # its W1 rate, which bench.run divides esk's by


@dataclass
class PeerRun:
    records: int
    ready_s: float
    processing_s: float
    max_rss_mb: float

    @property
    def rate(self) -> float:
        return self.records / self.processing_s


@dataclass
class QuixPeer:
    settings: Settings
    workdir: Path
    topic: str  # the commands
    partitions: int
    child: subprocess.Popen[bytes] | None = None

    @property
    def group(self) -> str:
        return f"{self.settings.app}.quix"

    @property
    def results(self) -> str:
        return f"{self.settings.app}.quix.results"

    @property
    def state_dir(self) -> Path:
        return self.workdir / "quix-state"

    @property
    def log_path(self) -> Path:
        return self.workdir / "quix.log"

    async def create_outputs(self) -> None:
        """The peer's outputs exist before it starts, so that its first output can be seen."""
        outputs = [f"{self.settings.app}.quix.events", self.results]
        await ensure_topics(self.settings, [TopicSpec(name, self.partitions, 1, {}) for name in outputs])

    def start(self) -> None:
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child owns it
        self.child = subprocess.Popen(
            [sys.executable, "-m", "bench.quix_app", self.settings.bootstrap_servers, self.topic, self.group,
             str(self.state_dir), self.settings.app],
            stdout=log, stderr=subprocess.STDOUT,
        )

    def stop(self) -> None:
        """SIGTERM: Quix Streams commits what it has processed and closes its state."""
        if self.child is None or self.child.poll() is not None:
            return
        self.child.terminate()
        try:
            self.child.wait(60)
        except subprocess.TimeoutExpired:
            self.child.kill()
            self.child.wait()

    def check_alive(self) -> None:
        if self.child is None or self.child.poll() is not None:
            raise RuntimeError(f"the Quix Streams peer exited; see {self.log_path}")


async def drain(peer: QuixPeer) -> PeerRun:
    """W1: start the peer and follow it until its group has committed the whole topic. It
    is timed from its first output (its first commit may come only once it is done)."""
    records = sum((await end_offsets(peer.settings, peer.topic)).values())
    started = time.perf_counter()
    peer.start()
    assert peer.child is not None
    ps = psutil.Process(peer.child.pid)
    rss: list[int] = []
    first_progress: float | None = None
    while True:
        await asyncio.sleep(0.5)
        peer.check_alive()
        rss.append(ps.memory_info().rss)
        if first_progress is None and sum((await end_offsets(peer.settings, peer.results)).values()) > 0:
            first_progress = time.perf_counter()
        if await committed_lag(peer.settings, peer.group, peer.topic) == 0:
            assert first_progress is not None
            return PeerRun(records, first_progress - started, time.perf_counter() - first_progress, max(rss) / 2**20)


async def restarts(peer: QuixPeer, aggregates: list[str], report: Report) -> None:
    """W3 for the peer, timed as esk's is (bench.measure.restarts): after a clean stop, then
    after losing its state directory (it restores from its changelog topics)."""
    for after in ("clean stop", "lost state"):
        if after == "lost state":
            shutil.rmtree(peer.state_dir)
        timed = await restart(peer.settings, peer.start, peer.topic, peer.results, probe_records(aggregates, f"quix {after}"), 3600)
        peer.check_alive()
        peer.stop()
        report.add("W3", w3_outputs_row(SYSTEM, after), timed.outputs_s, "s", f"{PROBES} new commands")


async def measure(settings: Settings, workdir: Path, topic: str, partitions: int, aggregates: list[str], report: Report) -> None:
    """W1, W5 and W3 for the peer, on the commands esk drained."""
    peer = QuixPeer(settings, workdir, topic, partitions)
    await peer.create_outputs()
    try:
        run = await drain(peer)
        peer.stop()
        report.add("W1", W1_ROW, run.rate, "commands/s", f"ready {run.ready_s:.1f}s")
        report.add("W5", f"{W1_ROW} max RSS", run.max_rss_mb, "MB")
        await restarts(peer, aggregates, report)
    finally:
        peer.stop()
