"""W4, the `customer_recent_orders` projection (PySpark into Delta Lake).

Catch-up rate: orders commands go onto the commands topic and one esk processor turns them
into order events (the events are the processor's own, nothing written around it); then
the projection catches up over all of them (`projections.runner.run`, what `esk project
run` calls), timed in a Spark session that has already built the empty table, so the rate
leaves out the JVM's start but keeps everything a catch-up does.

Lag: `esk project run customer_recent_orders --continuous` runs beside an API and the
processor; the load generator places orders at a steady rate over HTTP and each order's
lag is the time from its 200 answer (the event is committed) to the commit of the first
Delta table version that shows its row, read with delta-rs as the API reads it; the same
load runs unmeasured first, while the young JVM's batches are slow. The micro-batch
times of that run (from its log) show whether batches get slower as it goes.

One-shot: a few orders more over HTTP, then a fresh `esk project run` process, timed from
its start (the JVM's included) to its exit. Both it and the lag are measured once the API
has read its history index up (a new API reads every event there is).

Alone, on a scratch broker: `python -m bench.projection [--quick] [--events N]`.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import subprocess
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import httpx

from bench.cluster import Cluster, EskProcess, new_app, run_harness, scratch_broker, scratch_settings, workload_arguments
from bench.delta_watch import RowWatch
from bench.http_load import LoadSpec, as_request, run_load
from bench.measure import drain, percentile
from bench.results import Report, console
from bench.workload import command_records, customers_for, order_place, orders_commands, produce
from esk.kafka.topics import TopicNames
from esk.projections.catalog import Tables
from esk.settings import Settings

READ_MODEL = "customer_recent_orders"
LAG_PREFIX = "lag-"  # of the orders whose lag is measured
ONE_SHOT_PREFIX = "once-"
WARM_UP_PREFIX = "warm-"
WARM_UP_S = 30.0
CATCH_UP = f"{READ_MODEL} catch-up"
ONE_SHOT = f"{READ_MODEL} one-shot run, Spark's start included"
LAG_P50 = f"{READ_MODEL} lag p50 (HTTP 200 to visible row)"
LAG_P99 = f"{READ_MODEL} lag p99"
BATCH_FIRST = f"{READ_MODEL} continuous batch time, first third (median)"
BATCH_LAST = f"{READ_MODEL} continuous batch time, last third (median)"
BATCH_LINE = re.compile(r"batch (\d+): ([\d,]+) events, .* in ([\d.]+)s")


@dataclass(frozen=True)
class W4Sizes:
    events: int
    lag_rate: float  # orders per second
    lag_s: float
    one_shot_orders: int = 40


async def measure(base: Settings, workdir: Path, sizes: W4Sizes, budget_mb: int, report: Report) -> None:
    workdir = workdir / "w4"
    warehouse = workdir / "warehouse"
    settings = await new_app(
        base, "w4", projections=base.projections.model_copy(update={"warehouse_dir": warehouse})
    )
    cluster = Cluster(settings, workdir)
    processor = cluster.processor("processor", ESK_PROCESSOR__MEMORY_BUDGET_MB=str(budget_mb))
    try:
        await _catch_up(settings, processor, sizes.events, report)
        api = cluster.api("api")
        await asyncio.to_thread(cluster.start_all)
        await _history_read(api.url)
        # The one-shot run first: a continuous run stopped mid-batch would leave it a batch
        # to run again besides the new events.
        once = cluster.projection("one-shot", READ_MODEL, continuous=False, ESK_PROJECTIONS__WAREHOUSE_DIR=str(warehouse))
        await _one_shot(settings, api.url, once, sizes.one_shot_orders, report)
        continuous = cluster.projection("projection", READ_MODEL, ESK_PROJECTIONS__WAREHOUSE_DIR=str(warehouse))
        continuous.start()
        await _lag(settings, api.url, workdir, sizes, report)
        _batch_times(continuous, report)
    finally:
        cluster.stop_all()


async def _catch_up(settings: Settings, processor: EskProcess, n_events: int, report: Report) -> None:
    from esk.projections.catalog import load_read_models
    from esk.projections.runner import RunSummary, run
    from esk.projections.session import spark_session

    spark = await asyncio.to_thread(spark_session, settings, "esk-bench-w4")

    def timed() -> tuple[RunSummary, float]:
        started = time.perf_counter()
        summary = run(settings, load_read_models(settings.read_models)[READ_MODEL], spark=spark)
        return summary, time.perf_counter() - started

    try:
        _, empty_s = await asyncio.to_thread(timed)  # builds the empty table: a baseline
        names = TopicNames(settings.app)
        await produce(settings, names.commands, command_records(orders_commands(n_events, seed=4)))
        await drain(settings, processor, f"{settings.app}.processor", names.commands, settings.topics.partitions, 3600)
        summary, seconds = await asyncio.to_thread(timed)
    finally:
        await asyncio.to_thread(spark.stop)
    report.add("W4", CATCH_UP, summary.events / seconds, "events/s",
               f"{summary.events:,} events, {summary.batches} batch(es) in {seconds:.1f}s; "
               f"a run with no new events takes {empty_s:.1f}s")


async def _history_read(api_url: str, timeout_s: float = 600) -> None:
    """Returns once the API's history index has read the events topics: a new API reads
    all of them in a thread (a million events: half a minute of both cores), which would
    be measured as the one-shot's and the lag's time, not an API's that has been running."""
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(base_url=api_url, timeout=30) as client:
        while (await client.get("/v1/orders/ord-0/events")).status_code == 503:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the API's history index did not catch up in {timeout_s:.0f}s")
            await asyncio.sleep(0.5)


async def _lag(settings: Settings, api_url: str, workdir: Path, sizes: W4Sizes, report: Report) -> None:
    path = Tables(settings.projections.warehouse_dir).current_path(READ_MODEL)
    assert path is not None
    watch = RowWatch(path, "order_id", LAG_PREFIX)
    # The continuous query is up once an order placed now shows in the table.
    probe = f"{LAG_PREFIX}probe"
    async with httpx.AsyncClient(base_url=api_url, timeout=30) as client:
        r = await client.post(f"/v1/orders/{probe}/place", json={"customer_id": "probe", "lines": [{"sku": "s", "qty": 1, "price": 1}]})
        r.raise_for_status()
    await _until_visible(watch, {probe}, timeout_s=300)

    customers = customers_for(sizes.events)  # orders of the customers the table already has
    spec = LoadSpec(api_url, "orders for the lag", "places", rate=sizes.lag_rate, duration_s=sizes.lag_s,
                    customers=customers, seed=5, id_prefix=LAG_PREFIX)
    # A young JVM runs its first batches several times slower than later ones: the same
    # load, unmeasured, until its orders are visible.
    warm_watch = RowWatch(path, "order_id", WARM_UP_PREFIX)
    warm_up = await run_load(replace(spec, name="warm-up", duration_s=WARM_UP_S, seed=6, id_prefix=WARM_UP_PREFIX), workdir)
    warm_ids = {i for i, status in zip(warm_up.ids, warm_up.statuses, strict=True) if status == 200}
    await _until_visible(warm_watch, warm_ids, timeout_s=600)
    watch = RowWatch(path, "order_id", LAG_PREFIX)
    load = asyncio.create_task(run_load(spec, workdir))
    while not load.done():
        await asyncio.to_thread(watch.poll)
        await asyncio.sleep(0.5)
    placed = await load
    answered = {i: at for i, at, status in zip(placed.ids, placed.answered_at, placed.statuses, strict=True) if status == 200}
    trigger_s = settings.projections.trigger_interval_s
    # generous: a micro-batch takes longer the bigger the table (its trim reads all of it)
    missing = await _until_visible(watch, set(answered), timeout_s=600)
    lags = [watch.first_seen[i] - at for i, at in answered.items() if i in watch.first_seen]
    note = (f"{len(answered):,} orders over HTTP at {sizes.lag_rate:.0f}/s for {sizes.lag_s:.0f}s, "
            f"trigger every {trigger_s:g}s; {placed.describe_errors()}; {len(missing)} never visible")
    report.add("W4", LAG_P50, percentile(lags, 0.5), "s", note)
    report.add("W4", LAG_P99, percentile(lags, 0.99), "s")
    report.add("W4", f"{READ_MODEL} lag max", max(lags, default=float("nan")), "s")


def _batch_times(process: EskProcess, report: Report) -> None:
    """The continuous run's micro-batches that had events: the median time of the first
    and the last third, which tells a steady batch time from one that creeps up."""
    times = [float(m[3]) for m in BATCH_LINE.finditer(process.log_text()) if m[2] != "0"]
    if len(times) < 3:
        return
    third = len(times) // 3
    report.add("W4", BATCH_FIRST, percentile(times[:third], 0.5), "s", f"{len(times)} batches with events")
    report.add("W4", BATCH_LAST, percentile(times[-third:], 0.5), "s")


async def _one_shot(settings: Settings, api_url: str, process: EskProcess, n_orders: int, report: Report) -> None:
    """A few orders more, then `esk project run` in a fresh process, timed to its exit."""
    rng = random.Random(6)
    ids = [f"{ONE_SHOT_PREFIX}{n}" for n in range(n_orders)]
    async with httpx.AsyncClient(base_url=api_url, timeout=30) as client:
        for n, order_id in enumerate(ids):
            path, body, headers, _ = as_request(order_place(order_id, f"cust-{n}", rng))
            (await client.post(path, content=body, headers=headers)).raise_for_status()
    table = Tables(settings.projections.warehouse_dir).current_path(READ_MODEL)
    assert table is not None
    watch = RowWatch(table, "order_id", ONE_SHOT_PREFIX)
    started = time.perf_counter()
    process.start()
    assert process.process is not None
    code = await asyncio.to_thread(process.process.wait, 600)
    seconds = time.perf_counter() - started
    if code:
        raise subprocess.CalledProcessError(code, f"esk project run; see {process.log_path}")
    watch.poll()
    report.add("W4", ONE_SHOT, seconds, "s",
               f"a fresh `esk project run` over {n_orders} new orders; {len(watch.first_seen)} of them visible after it")


async def _until_visible(watch: RowWatch, ids: set[str], timeout_s: float) -> set[str]:
    """Poll until every id is visible or the time is up; returns the ids still missing."""
    deadline = time.monotonic() + timeout_s
    while True:
        await asyncio.to_thread(watch.poll)
        missing = ids - watch.first_seen.keys()
        if not missing or time.monotonic() > deadline:
            return missing
        await asyncio.sleep(0.5)


QUICK = W4Sizes(events=20_000, lag_rate=10, lag_s=40)
FULL = W4Sizes(events=1_000_000, lag_rate=20, lag_s=1800)  # the lag's bound holds over half an hour


def ratios(report: Report) -> list[tuple[str, float | None, str]]:
    first, last = report.get("W4", BATCH_FIRST), report.get("W4", BATCH_LAST)
    return [
        ("W4 catch-up events/s", report.get("W4", CATCH_UP), ">= 100,000"),
        ("W4 one-shot run, Spark's start included (s)", report.get("W4", ONE_SHOT), "<= 15"),
        ("W4 lag p50 (s)", report.get("W4", LAG_P50), "<= 2"),
        ("W4 lag p99 (s)", report.get("W4", LAG_P99), "<= 5"),
        ("W4 batch time, last third / first third", last / first if first and last else None, "about 1 (no creeping up)"),
    ]


async def run(sizes: W4Sizes, partitions: int, budget_mb: int) -> Report:
    """W4 alone, on a scratch broker of its own."""
    async with scratch_broker("esk-w4") as broker:
        report = Report(0, sizes.events, partitions)
        workdir = Path(tempfile.mkdtemp(prefix="esk-w4-"))
        console.print(f"broker on {broker.bootstrap}; work in {workdir}")
        await measure(scratch_settings(broker, "w4", partitions), workdir, sizes, budget_mb, report)
        return report


def main() -> None:
    def sizes_of_w4(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--events", type=int, help="events to catch up over (overrides the size's)")
        parser.add_argument("--lag-s", type=float, help="seconds of steady load for the lag")

    args = workload_arguments(__doc__, sizes_of_w4)
    sizes = QUICK if args.quick else FULL
    sizes = W4Sizes(args.events or sizes.events, sizes.lag_rate, args.lag_s or sizes.lag_s, sizes.one_shot_orders)
    report = run_harness(run(sizes, args.partitions, args.budget_mb))
    for name, value, target in ratios(report):
        console.print(f"{name}: {'n/a' if value is None else f'{value:.2f}'}  (target {target})", highlight=False)


if __name__ == "__main__":
    main()
