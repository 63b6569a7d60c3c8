"""W4, the `customer_recent_orders` projection (PySpark into Delta Lake).

Catch-up rate: orders commands go onto the commands topic and one esk processor turns them
into order events (the events are the processor's own, nothing written around it); then
the projection catches up over all of them (`projections.runner.run`, what `esk project
run` calls), timed in a Spark session that has already built the empty table, so the rate
leaves out the JVM's start but keeps everything a catch-up does.

Lag: `esk project run customer_recent_orders --continuous` runs beside an API and the
processor; the load generator places orders at a steady rate over HTTP and each order's
lag is the time from its 200 answer (the event is committed) to the commit of the first
Delta table version that shows its row, read with delta-rs as the API reads it.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.cluster import Cluster, EskProcess, new_app
from bench.delta_watch import RowWatch
from bench.http_load import LoadSpec, run_load
from bench.measure import drain, percentile
from bench.results import Report
from bench.workload import command_records, customers_for, orders_commands, produce
from esk.kafka.topics import TopicNames
from esk.settings import Settings

READ_MODEL = "customer_recent_orders"
LAG_PREFIX = "lag-"  # of the orders whose lag is measured


@dataclass(frozen=True)
class W4Sizes:
    events: int
    lag_rate: float  # orders per second
    lag_s: float


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
        cluster.projection("projection", READ_MODEL, ESK_PROJECTIONS__WAREHOUSE_DIR=str(warehouse))
        await asyncio.to_thread(cluster.start_all)
        await _lag(settings, api.url, workdir, sizes, report)
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
    report.add("W4", f"{READ_MODEL} catch-up", summary.events / seconds, "events/s",
               f"{summary.events:,} events, {summary.batches} batch(es) in {seconds:.1f}s; "
               f"a run with no new events takes {empty_s:.1f}s")


async def _lag(settings: Settings, api_url: str, workdir: Path, sizes: W4Sizes, report: Report) -> None:
    from esk.projections.catalog import Tables

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
    report.add("W4", f"{READ_MODEL} lag p50 (HTTP 200 to visible row)", percentile(lags, 0.5), "s", note)
    report.add("W4", f"{READ_MODEL} lag max", max(lags, default=float("nan")), "s")


async def _until_visible(watch: RowWatch, ids: set[str], timeout_s: float) -> set[str]:
    """Poll until every id is visible or the time is up; returns the ids still missing."""
    deadline = time.monotonic() + timeout_s
    while True:
        await asyncio.to_thread(watch.poll)
        missing = ids - watch.first_seen.keys()
        if not missing or time.monotonic() > deadline:
            return missing
        await asyncio.sleep(0.5)
