"""W6, subscriptions: the example's `customer_ledger` (a database handler writing to SQLite
exactly once) and `payments` (a reactor: its commands and its offsets in one Kafka
transaction), each run as `esk subscriber NAME`, its own process.

Catch-up: one esk processor turns orders commands (a quarter of the orders placed with
`pay_from`) into order events; the processor stops; then each subscriber in turn, alone,
reads the events topic from its beginning until it has caught up. Its rate counts from its
first committed progress (the process's start and its group join left out) and is set
against the ceiling: the raw read_committed consume of the same events topic in the same
run, which decodes nothing, calls no handler and writes nothing. (`payments` also reads
the outcomes topic, passing over what its own commands did not cause: that work counts
against it.)

Lag under load: an API, the processor and both subscribers; orders placed over HTTP at W2's
fixed rate, the reactor paying a quarter of them from accounts that cannot pay, so each of
those orders is cancelled (the saga's longest path). Each subscription's lag, in records
behind the end of its topics, is sampled twice a second; then the time each takes to catch
up once the load stops.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench import ceilings
from bench.cluster import Cluster, EskProcess, new_app, run_harness, scratch_broker, scratch_settings, workload_arguments
from bench.http_e2e import FIXED_RATE
from bench.http_load import LoadSpec, run_load
from bench.measure import drain, percentile
from bench.results import Report, console
from bench.workload import PAYING_ACCOUNTS, command_records, customers_for, orders_commands, produce
from esk.kafka.topics import TopicNames
from esk.registry import load_registry
from esk.settings import Settings
from esk.subscriptions.catalog import load_subscriptions
from esk.subscriptions.operations import SubscriptionOperations, SubscriptionStatus

SUBSCRIPTIONS = ("customer_ledger", "payments")
CEILING = "read_committed consume of the events (ceiling)"
PAY_FROM_SHARE = 0.25
CEILING_RUNS = 5


@dataclass(frozen=True)
class W6Sizes:
    events: int
    lag_rate: float  # orders per second over HTTP
    lag_s: float


QUICK = W6Sizes(events=100_000, lag_rate=FIXED_RATE, lag_s=20)
FULL = W6Sizes(events=300_000, lag_rate=FIXED_RATE, lag_s=60)


def catch_up_row(name: str) -> str:
    return f"{name} catch-up"


async def measure(base: Settings, workdir: Path, sizes: W6Sizes, budget_mb: int, report: Report) -> None:
    workdir = workdir / "w6"
    data_dir = workdir / "subscriptions"
    settings = await new_app(base, "w6")
    # what the measurements read: the subscribers' databases, not the current directory's
    settings = settings.model_copy(update={"subscriber": settings.subscriber.model_copy(update={"data_dir": data_dir})})
    registry = load_registry(settings.domain)
    subscriptions = load_subscriptions(settings.subscriptions)
    operations = {name: SubscriptionOperations(settings, subscriptions[name], registry) for name in SUBSCRIPTIONS}
    cluster = Cluster(settings, workdir)
    processor = cluster.processor("processor", ESK_PROCESSOR__MEMORY_BUDGET_MB=str(budget_mb))
    try:
        names = TopicNames(settings.app)
        commands = orders_commands(sizes.events, seed=6, pay_from_share=PAY_FROM_SHARE)
        await produce(settings, names.commands, command_records(commands))
        await drain(settings, processor, f"{settings.app}.processor", names.commands, settings.topics.partitions, 3600)
        processor.stop()
        events_topic = names.events("orders")
        # a read over in a second or two: the median of a few is steadier than one
        runs = sorted([await ceilings.aiokafka_consume(settings, events_topic, sizes.events, isolation_level="read_committed")
                       for _ in range(CEILING_RUNS)])
        report.add("W6", CEILING, sizes.events / runs[len(runs) // 2], "events/s",
                   f"{sizes.events:,} order events, the median of {CEILING_RUNS} reads")
        for name in SUBSCRIPTIONS:
            subscriber = cluster.subscriber(name, name, data_dir)
            rate = await _catch_up(subscriber, operations[name], events_topic, sizes.events)
            report.add("W6", catch_up_row(name), rate, "events/s",
                       f"{subscriptions[name].kind.value}, from its first committed progress to caught up")
            subscriber.stop()
        await _lag(cluster, operations, data_dir, workdir, sizes, report)
    finally:
        cluster.stop_all()


def _progress(status: SubscriptionStatus, topic: str) -> tuple[int, int]:
    """(offsets committed, offsets in all) of `topic`'s partitions."""
    parts = [p for p in status.partitions if p.topic == topic]
    return sum(p.end - p.lag for p in parts), sum(p.end for p in parts)


async def _catch_up(subscriber: EskProcess, operations: SubscriptionOperations, topic: str, events: int) -> float:
    subscriber.start()
    first: tuple[float, int] | None = None
    deadline = time.perf_counter() + 3600
    while True:
        status = await operations.status()
        now = time.perf_counter()
        done, offsets = _progress(status, topic)
        if first is None and done > 0:
            first = (now, done)
        if status.caught_up and first is not None:
            break
        if not subscriber.alive or now > deadline:
            raise RuntimeError(f"{subscriber.name} did not catch up; see {subscriber.log_path}")
        await asyncio.sleep(0.2)
    if done == first[1]:
        raise RuntimeError(f"{subscriber.name} caught up before a second sample: measure more events")
    # offsets count the transactions' markers too: scale them to events
    return (done - first[1]) / (now - first[0]) * events / offsets


async def _lag(
    cluster: Cluster, operations: dict[str, SubscriptionOperations], data_dir: Path, workdir: Path, sizes: W6Sizes, report: Report
) -> None:
    api = cluster.api("api")
    for name in SUBSCRIPTIONS:
        cluster.subscriber(name, name, data_dir)
    await asyncio.to_thread(cluster.start_all)
    opens = await run_load(LoadSpec(api.url, "open the paying accounts", "opens", concurrency=64, accounts=PAYING_ACCOUNTS), workdir)
    if opens.errors:
        raise RuntimeError(f"opening the accounts: {opens.describe_errors()}")
    spec = LoadSpec(api.url, "orders while subscribed", "places", rate=sizes.lag_rate, duration_s=sizes.lag_s,
                    customers=customers_for(sizes.events), seed=9, id_prefix="w6-", pay_from_share=PAY_FROM_SHARE)
    load = asyncio.create_task(run_load(spec, workdir))
    lags: dict[str, list[int]] = {name: [] for name in SUBSCRIPTIONS}
    while not load.done():
        for name, statuses in lags.items():
            statuses.append((await operations[name].status()).lag)
        await asyncio.sleep(0.5)
    placed = await load
    stopped = time.perf_counter()
    behind: dict[str, float] = {}  # seconds from the end of the load to caught up
    while len(behind) < len(SUBSCRIPTIONS) and time.perf_counter() - stopped < 600:
        for name in set(SUBSCRIPTIONS) - behind.keys():
            if (await operations[name].status()).caught_up:
                behind[name] = time.perf_counter() - stopped
        await asyncio.sleep(0.25)
    note = f"{len(placed.statuses):,} orders over HTTP at {sizes.lag_rate:,.0f}/s for {sizes.lag_s:.0f}s (achieved {placed.rate:,.0f}/s); {placed.describe_errors()}"
    for name, samples in lags.items():
        report.add("W6", f"{name} lag p50 under load", percentile([float(s) for s in samples], 0.5), "records", note)
        report.add("W6", f"{name} lag p99 under load", percentile([float(s) for s in samples], 0.99), "records")
        report.add("W6", f"{name} caught up after the load", behind.get(name, float("nan")), "s",
                   "" if name in behind else "not within 10 minutes")


async def run(sizes: W6Sizes, partitions: int, budget_mb: int) -> Report:
    """W6 alone, on a scratch broker of its own."""
    async with scratch_broker("esk-w6") as broker:
        report = Report(0, PAYING_ACCOUNTS, partitions)
        workdir = Path(tempfile.mkdtemp(prefix="esk-w6-"))
        console.print(f"broker on {broker.bootstrap}; work in {workdir}")
        await measure(scratch_settings(broker, "w6", partitions), workdir, sizes, budget_mb, report)
        return report


def ratios(report: Report) -> list[tuple[str, float | None, str]]:
    ceiling = report.get("W6", CEILING)
    out: list[tuple[str, float | None, str]] = []
    for name in SUBSCRIPTIONS:
        rate = report.get("W6", catch_up_row(name))
        out.append((f"W6 {name} events/s / read_committed consume ceiling", rate / ceiling if rate and ceiling else None, ">= 0.5"))
    return out


def main() -> None:
    args = workload_arguments(__doc__)
    report = run_harness(run(QUICK if args.quick else FULL, args.partitions, args.budget_mb))
    for name, value, target in ratios(report):
        console.print(f"{name}: {'n/a' if value is None else f'{value:.2f}'}  (target {target})", highlight=False)


if __name__ == "__main__":
    main()
