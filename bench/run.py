"""The benchmark harness: every workload side by side with its ceiling and a peer, in one
run, on one embedded broker. `make bench-quick` (minutes) or `make bench` (a million
commands; writes docs/benchmarks.md and docs/benchmarks.png).

Figures are rates measured in the same run; the report quotes ratios against the
ceilings and the peer, because this machine is noisy.
"""

from __future__ import annotations

import argparse
import platform
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from rich.table import Table

from bench import ceilings, http_e2e, measure, peer, projection, subscribers
from bench.cluster import Cluster, run_harness, scratch_broker, scratch_settings
from bench.http_e2e import W2Sizes
from bench.measure import drain, histogram_quantile, restarts, w3_outputs_row
from bench.projection import W4Sizes
from bench.results import Report, console
from bench.subscribers import W6Sizes
from bench.workload import account_ids, accounts_commands, command_records, produce
from esk.kafka.reader import read_committed
from esk.kafka.topics import TopicNames, TopicSpec, ensure_topics, topic_specs
from esk.registry import load_registry


@dataclass(frozen=True)
class Sizes:
    commands: int
    accounts: int
    w2: W2Sizes
    w4: W4Sizes
    w6: W6Sizes


QUICK = Sizes(50_000, 5_000, http_e2e.QUICK,
              W4Sizes(events=50_000, lag_rate=20, lag_s=30), subscribers.QUICK)
FULL = Sizes(1_000_000, 100_000, http_e2e.FULL,
             projection.FULL, subscribers.FULL)


async def run(sizes: Sizes, partitions: int, budget_mb: int, with_peer: bool) -> Report:
    commands_n, accounts_n = sizes.commands, sizes.accounts
    report = Report(commands_n, accounts_n, partitions)
    async with scratch_broker("esk-bench") as broker:
        broker_pid = broker.pid()
        assert broker_pid is not None
        workdir = Path(tempfile.mkdtemp(prefix="esk-bench-"))
        console.print(f"broker on {broker.bootstrap}; work in {workdir}")
        settings = scratch_settings(broker, "bench", partitions)
        registry = load_registry(settings.domain)
        names = TopicNames(settings.app)
        raw = [TopicSpec(f"{settings.app}.{name}", partitions, 1, {}) for name in ("raw", "perf")]
        await ensure_topics(settings, topic_specs(settings, registry) + raw)
        commands = accounts_commands(commands_n, accounts_n, seed=42)
        records = command_records(commands)
        mean_size = sum(len(v) for _, v in records) / len(records)

        # -- ceilings: the raw client rates for the same records ---------------------------
        seconds = await produce(settings, names.commands, records)
        report.add("C", "aiokafka produce (acks=all)", commands_n / seconds, "records/s")
        seconds = await ceilings.aiokafka_transactional_produce(settings, f"{settings.app}.raw", records)
        report.add("C", "aiokafka produce, esk's batches in transactions", commands_n / seconds, "records/s")
        seconds = await ceilings.aiokafka_consume(settings, names.commands, commands_n)
        report.add("C", "aiokafka consume", commands_n / seconds, "records/s")
        for system, rate in ceilings.confluent_rates(settings, records, f"{settings.app}.raw"):
            report.add("C", system, rate, "records/s")
        for system, rate in ceilings.kafka_perf_tools(broker, settings, commands_n, int(mean_size)):
            report.add("C", system, rate, "records/s")

        # -- W1: esk processor drains the topic --------------------------------------------
        cluster = Cluster(settings, workdir)
        processor = cluster.processor("processor", ESK_PROCESSOR__MEMORY_BUDGET_MB=str(budget_mb))
        group = f"{settings.app}.processor"
        try:
            w1 = await drain(settings, processor, group, names.commands, partitions, timeout_s=3600)
            assert w1.drained_after_s is not None and w1.ready_after_s is not None
            processing_s = w1.drained_after_s - w1.ready_after_s
            report.add("W1", "esk processor", commands_n / processing_s, "commands/s",
                       f"ready {w1.ready_after_s:.1f}s, drained {w1.drained_after_s:.1f}s")
            for q in (0.5, 0.99):
                bound = histogram_quantile(processor, "esk_commit_seconds", q)
                if bound is not None:
                    report.add("W1", f"esk commit latency p{int(q * 100)} (<=)", bound * 1000, "ms")
            report.add("W5", "esk processor max RSS", w1.max_rss_mb, "MB", f"budget {budget_mb} MB")
            events = len(await read_committed(settings, names.events("accounts")))
            report.add("W1", "events emitted", events, "events")

            # -- W3: restart after a clean stop, and after losing the state ----------------
            processor.stop()
            await restarts(settings, processor, partitions, account_ids(accounts_n), report)
        finally:
            cluster.stop_all()

        # -- W2, W6 and W4, each on an application of its own -----------------------------
        await http_e2e.measure(settings, workdir, sizes.w2, budget_mb, broker_pid, report)
        await subscribers.measure(settings, workdir, sizes.w6, budget_mb, report)
        await projection.measure(settings, workdir, sizes.w4, budget_mb, report)

        # -- the peer: the same validation as a Quix Streams app, W1 and W3 ----------------
        if with_peer:
            await peer.measure(settings, workdir, names.commands, partitions, account_ids(accounts_n), report)
        return report


def ratios(report: Report, budget_mb: int) -> list[tuple[str, float | None, str]]:
    w1 = report.get("W1", "esk processor")
    # the way esk uses the client: record batches inside transactions
    produce = report.get("C", "aiokafka produce, esk's batches in transactions")
    consume = report.get("C", "aiokafka consume")
    quix = report.get("W1", peer.W1_ROW)
    client_ceiling = None
    if produce and consume:
        # each command reads one record and writes about three: the ceiling is the rate at
        # which the client could move that traffic
        client_ceiling = 1 / (1 / consume + ceilings.WRITES_PER_COMMAND / produce)
    out = [
        ("W1 esk / client ceiling (1 read + 3 writes)", w1 / client_ceiling if w1 and client_ceiling else None, ">= 0.5"),
        ("W1 esk / Quix Streams", w1 / quix if w1 and quix else None, ">= 1.5"),
    ]
    for after in ("clean stop", "lost state"):
        # restart speed: the peer's time over esk's, so that above 1 means esk is faster
        esk_s = report.get("W3", w3_outputs_row("esk", after))
        quix_s = report.get("W3", w3_outputs_row(peer.SYSTEM, after))
        out.append((f"W3 esk / Quix Streams, restart after {after} (Quix s / esk s)",
                    quix_s / esk_s if esk_s and quix_s else None, "none set"))
    rebuild, restore = report.get("W3", measure.REBUILD_RATE), report.get("W3", "esk full restore rate")
    out.append(("W3 esk rebuild events/s / full restore records/s", rebuild / restore if rebuild and restore else None, ">= 1"))
    rss = report.get("W5", "esk processor max RSS")
    over = rss - budget_mb if rss is not None else None
    return [
        *out,
        ("W5 esk max RSS minus the RocksDB budget (MB)", over, "<= 150"),
        ("W2 commands/s over HTTP at saturation", report.get("W2", http_e2e.SATURATION), ">= 3000"),
        (f"W2 p99 latency at {http_e2e.FIXED_RATE:,} commands/s (ms)", report.get("W2", http_e2e.latency_row("p99", http_e2e.FIXED_RATE)), "<= 50"),
        *subscribers.ratios(report),
        *projection.ratios(report),
    ]


def render(report: Report) -> Table:
    table = Table(title=f"esk benchmarks: {report.commands:,} commands, {report.accounts:,} accounts, {report.partitions} partitions")
    for column in ("workload", "system", "value", "unit", "note"):
        table.add_column(column, justify="right" if column == "value" else "left")
    for r in report.rows:
        table.add_row(r.workload, r.system, f"{r.value:,.1f}", r.unit, r.note)
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="50k commands over 5k accounts, smaller W2 and W4")
    parser.add_argument("--no-peer", action="store_true")
    parser.add_argument("--write", action="store_true", help="write docs/benchmarks.md and docs/benchmarks.png")
    parser.add_argument("--budget-mb", type=int, default=128)
    args = parser.parse_args()
    started = time.perf_counter()
    report = run_harness(run(QUICK if args.quick else FULL, 6, args.budget_mb, not args.no_peer))
    console.print(render(report))
    for name, value, target in ratios(report, args.budget_mb):
        console.print(f"{name}: {'n/a' if value is None else f'{value:.2f}'}  (target {target})", highlight=False)
    console.print(f"benchmark took {time.perf_counter() - started:.0f}s on {platform.node()}")
    if args.write:
        from bench.report import write

        write(report, ratios(report, args.budget_mb), Path(__file__).resolve().parent.parent / "docs")


if __name__ == "__main__":
    main()
