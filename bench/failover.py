"""Failover with and without standby replicas: how long until the surviving processor owns
every partition again, and how many changelog records it replayed to get there.

    python -m bench.failover [--quick]

For each setting (0 and 1 standby replicas) and each way of going away, on fresh topics:
accounts commands are drained by processor p0 alone; p1 joins and takes half the
partitions (and, with a standby, warm copies of p0's half); once the group settled, p0
goes away: a clean stop (SIGTERM: a rolling deploy) or a SIGKILL (a crash: the time
includes the group's session timeout, the same with or without standbys).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from aiokafka.errors import GroupCoordinatorNotAvailableError
from rich.console import Console
from rich.table import Table

from bench.cluster import Cluster, EskProcess, metric_sum, run_harness, scratch_broker, scratch_settings
from bench.measure import drain
from bench.workload import accounts_commands, command_records, committed_lag, produce
from esk.kafka.topics import TopicNames, ensure_topics, topic_specs
from esk.registry import load_registry
from esk.settings import Settings

SESSION_TIMEOUT_MS = 6000

console = Console()


@dataclass
class Failover:
    standby_replicas: int
    how: str  # "clean stop" or "SIGKILL"
    seconds: float  # from p0's end until p1 owns every partition, restored
    handover_s: float  # from p1 giving up its partitions for the new assignment until then
    replayed: float

    def describe(self) -> str:
        return (
            f"{self.standby_replicas} standby replicas, p0 gone by {self.how}: p1 owned everything after "
            f"{self.seconds:.2f}s (handover {self.handover_s:.2f}s), replaying {self.replayed:,.0f} records"
        )


def labelled_metric(process: EskProcess, name: str, **labels: str) -> float:
    """`process.metric`, except that a busy process that is slow to answer is asked again
    rather than read as zero."""
    for attempt in range(10):
        try:
            text = process.metrics_text(timeout_s=5)
            break
        except httpx.HTTPError:
            if attempt == 9:
                raise
            time.sleep(0.1)
    return metric_sum(text, name, **labels) or 0.0


async def settled(survivor: EskProcess, other: EskProcess, partitions: int, standbys: int) -> None:
    """Wait until the two own every partition between them and the survivor's standby
    copies have stopped moving (caught up with the changelog)."""
    last, quiet_since = -1.0, time.monotonic()
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        await asyncio.sleep(0.25)
        owned = labelled_metric(survivor, "esk_active_tasks") + labelled_metric(other, "esk_active_tasks")
        keeping = labelled_metric(survivor, "esk_standby_tasks")
        applied = labelled_metric(survivor, "esk_restore_records_total", role="standby")
        if applied != last:
            last, quiet_since = applied, time.monotonic()
        if owned == partitions and keeping == standbys and time.monotonic() - quiet_since > 1.5:
            return
    raise TimeoutError("the group did not settle in 600s")


async def take_over(gone: EskProcess, survivor: EskProcess, partitions: int, kill: bool) -> Failover:
    """From p0's end until the survivor owns every partition, restored: the seconds, the
    seconds since the survivor gave up its own partitions for the new assignment (the
    rebalance and the restore, without the time to notice a crash), and the changelog
    records the survivor replayed meanwhile."""
    before = labelled_metric(survivor, "esk_restore_records_total", role="processor")
    owned_before = labelled_metric(survivor, "esk_active_tasks")
    started = time.perf_counter()
    revoked_at = None
    if kill:
        await asyncio.to_thread(gone.kill)
    else:
        gone.signal(signal.SIGTERM)
    while (owned := labelled_metric(survivor, "esk_active_tasks")) != partitions:
        if revoked_at is None and owned != owned_before:
            revoked_at = time.perf_counter()
        if time.perf_counter() - started > 600:
            raise TimeoutError("no takeover in 600s")
        await asyncio.sleep(0.01)
    done = time.perf_counter()
    replayed = labelled_metric(survivor, "esk_restore_records_total", role="processor") - before
    return Failover(0, "", done - started, done - (revoked_at or started), replayed)


async def coordinator_ready(settings: Settings, group: str) -> None:
    """A broker that has just started may not have its group coordinator yet."""
    for _ in range(120):
        try:
            await committed_lag(settings, group, TopicNames(settings.app).commands)
            return
        except GroupCoordinatorNotAvailableError:
            await asyncio.sleep(0.5)
    raise TimeoutError("no group coordinator after 60s")


async def measure(
    base: Settings, workdir: Path, commands: int, accounts: int, standby_replicas: int, kill: bool
) -> Failover:
    how = "SIGKILL" if kill else "clean stop"
    settings = base.model_copy(update={"app": f"{base.app}s{standby_replicas}{'k' if kill else 't'}"})
    partitions = settings.topics.partitions
    names = TopicNames(settings.app)
    await ensure_topics(settings, topic_specs(settings, load_registry(settings.domain)))
    await produce(settings, names.commands, command_records(accounts_commands(commands, accounts, seed=7)))
    cluster = Cluster(settings, workdir / settings.app)
    env = {
        "ESK_PROCESSOR__STANDBY_REPLICAS": str(standby_replicas),
        "ESK_PROCESSOR__SESSION_TIMEOUT_MS": str(SESSION_TIMEOUT_MS),
    }
    p0, p1 = cluster.processor("p0", **env), cluster.processor("p1", **env)
    try:
        await coordinator_ready(settings, f"{settings.app}.processor")
        await drain(settings, p0, f"{settings.app}.processor", names.commands, partitions, timeout_s=3600)
        p1.start()
        await settled(p1, p0, partitions, partitions // 2 if standby_replicas else 0)
        failover = await take_over(p0, p1, partitions, kill)
        failover.standby_replicas, failover.how = standby_replicas, how
        console.print(failover.describe(), highlight=False)
        return failover
    finally:
        cluster.stop_all()


async def run(commands: int, accounts: int, partitions: int) -> list[Failover]:
    async with scratch_broker("esk-failover") as broker:
        settings = scratch_settings(broker, "fo", partitions)
        workdir = Path(tempfile.mkdtemp(prefix="esk-failover-"))
        return [
            await measure(settings, workdir, commands, accounts, standby, kill) for kill in (False, True) for standby in (0, 1)
        ]


def render(results: list[Failover], commands: int, accounts: int) -> Table:
    table = Table(title=f"failover: {commands:,} commands over {accounts:,} accounts, 2 processors")
    for column in ("standby replicas", "p0 goes away by", "takeover (s)", "handover (s)", "records replayed"):
        table.add_column(column, justify="right")
    for f in results:
        table.add_row(str(f.standby_replicas), f.how, f"{f.seconds:.2f}", f"{f.handover_s:.2f}", f"{f.replayed:,.0f}")
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="50k commands over 5k accounts")
    args = parser.parse_args()
    commands, accounts = (50_000, 5_000) if args.quick else (1_000_000, 100_000)
    results = run_harness(run(commands, accounts, 6))
    console.print(render(results, commands, accounts))


if __name__ == "__main__":
    main()
