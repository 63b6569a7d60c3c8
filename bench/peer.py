"""Runs the Quix Streams peer (bench/quix_app.py) as a child process on the same topic."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from app.settings import Settings
from app.kafka.topics import TopicSpec, ensure_topics
from bench.workload import committed_lag, end_offsets


@dataclass
class PeerRun:
    ready_s: float
    processing_s: float
    max_rss_mb: float


async def run_quix(settings: Settings, workdir: Path, topic: str, records: int, partitions: int) -> PeerRun:
    group = f"{settings.app}.quix"
    # The peer's outputs exist before it starts, so that its first output can be seen: that
    # is when it started processing (its first commit may come only once it is done).
    outputs = [f"{settings.app}.quix.{name}" for name in ("events", "results")]
    await ensure_topics(settings, [TopicSpec(name, partitions, 1, {}) for name in outputs])
    log = open(workdir / "quix.log", "wb")  # noqa: SIM115 - the child owns it
    started = time.perf_counter()
    child = subprocess.Popen(
        [sys.executable, "-m", "bench.quix_app", settings.bootstrap_servers, topic, group, str(workdir / "quix-state"), settings.app],
        stdout=log, stderr=subprocess.STDOUT,
    )
    ps = psutil.Process(child.pid)
    rss: list[int] = []
    first_progress: float | None = None
    try:
        while True:
            await asyncio.sleep(0.5)
            if child.poll() is not None:
                raise RuntimeError(f"the Quix Streams peer exited; see {workdir / 'quix.log'}")
            rss.append(ps.memory_info().rss)
            if first_progress is None and sum((await end_offsets(settings, outputs[1])).values()) > 0:
                first_progress = time.perf_counter()
            lag = await committed_lag(settings, group, topic)
            now = time.perf_counter()
            if lag == 0:
                assert first_progress is not None
                return PeerRun(first_progress - started, now - first_progress, max(rss) / 2**20)
    finally:
        child.terminate()
        child.wait(30)
