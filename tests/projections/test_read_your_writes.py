"""Read-your-writes against the real broker, processor, API and a Spark read model: a read
given a command answer's position waits until the read model reflects that command, and
says so when it does not in time; and a new user's own read model, over their own domain
and written with `import esk` alone, run continuously, shows a command's row."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

pyspark = pytest.importorskip("pyspark")

from pyspark.sql import DataFrame, SparkSession  # noqa: E402
from pyspark.sql import functions as F  # noqa: E402

import esk  # noqa: E402
from esk.api.http import NO_RUN  # noqa: E402
from esk.projections.catalog import Tables  # noqa: E402
from esk.projections.runner import run  # noqa: E402
from esk.settings import Settings  # noqa: E402
from projections.read_models import READ_MODELS  # noqa: E402
from tests.counters import Added, counters  # noqa: E402
from tests.projections.settings import counters_settings  # noqa: E402
from tests.system import system, wait_for  # noqa: E402

pytestmark = [pytest.mark.kafka, pytest.mark.spark]

BALANCES = {p.model.name: p for p in READ_MODELS}["account_balances"]


async def test_a_read_after_a_commands_position_shows_that_command(settings: Settings, spark: SparkSession, tmp_path: Path) -> None:
    settings = settings.model_copy(
        update={
            "projections": settings.projections.model_copy(update={"warehouse_dir": tmp_path / "warehouse"}),
            "api": settings.api.model_copy(update={"read_wait_max_s": 120}),  # a Spark run on a busy machine
        }
    )
    url = f"/v1/projections/{BALANCES.model.name}"
    async with system(settings) as s:
        opened = await s.client.post("/v1/accounts/ryw-1/open", json={"owner": "ada"})
        assert opened.status_code == 200, opened.text
        first = {"account_id": "ryw-1", "after": opened.json()["position"]["token"]}
        # not built yet, and not built in time: said so
        r = await s.client.get(url, params={**first, "wait_ms": 300})
        assert r.status_code == 503 and r.json()["code"] == "projection_not_built", r.text
        assert r.json()["detail"] == f"account_balances has not been built yet: run `esk project run account_balances`; {NO_RUN}"
        assert "retry-after" not in r.headers
        r = await s.client.get(url, params={"account_id": "ryw-1", "wait_ms": 300})  # a wait without positions
        assert r.status_code == 503 and r.json()["code"] == "projection_not_built", r.text
        # a driver that left it out (its code's mistake, esk dev's): said so and why, not "no run"
        note = Tables(settings.projections.warehouse_dir).left_out_note(BALANCES.model.name)
        assert note.acquire()
        note.held_up("its apply fails; fix its code")
        r = await s.client.get(url, params={"account_id": "ryw-1"})
        assert r.status_code == 503 and "retry-after" not in r.headers, r.text
        assert r.json()["detail"].startswith(
            "account_balances has not been built yet: run `esk project run account_balances`; the driver running the read "
            "models left it out (pid "
        ) and r.json()["detail"].endswith("): its apply fails; fix its code"), r.text
        note.release()
        # a read that waits waits for the first build too, with positions or without
        waiting = asyncio.create_task(s.client.get(url, params={**first, "wait_ms": 120_000}, timeout=150))
        waiting_alone = asyncio.create_task(s.client.get(url, params={"account_id": "ryw-1", "wait_ms": 120_000}, timeout=150))
        await asyncio.sleep(0.5)
        assert not waiting.done() and not waiting_alone.done()
        await asyncio.to_thread(run, settings, BALANCES, spark=spark)
        for read in (waiting, waiting_alone):
            r = await asyncio.wait_for(read, 30)
            assert r.status_code == 200, r.text
            assert [row["balance"] for row in r.json()["rows"]] == [0]

        deposited = await s.client.post("/v1/accounts/ryw-1/deposit", json={"amount": 40})
        token = deposited.json()["position"]["token"]
        # nothing projects meanwhile: not reflected in time, and the answer says how far it got
        r = await s.client.get(url, params={"account_id": "ryw-1", "after": token, "wait_ms": 300})
        assert r.status_code == 503 and r.json()["code"] == "not_caught_up", r.text
        assert r.json()["positions"]
        assert r.json()["detail"].endswith(f"; {NO_RUN}")  # waiting longer would not help, nor would a retry
        assert "retry-after" not in r.headers
        with Tables(settings.projections.warehouse_dir).run_lock("account_balances", 1) as kept:
            kept.acquire()  # as a run keeping it up would: then it is only late
            r = await s.client.get(url, params={"account_id": "ryw-1", "after": token, "wait_ms": 300})
            assert r.status_code == 503 and r.json()["code"] == "not_caught_up" and NO_RUN not in r.json()["detail"], r.text
            assert r.headers["retry-after"] == "1"
        with Tables(settings.projections.warehouse_dir).run_lock("account_balances", 2) as building:
            building.acquire()  # as a run building the next generation beside it would
            r = await s.client.get(url, params={"account_id": "ryw-1", "after": token, "wait_ms": 300})
            assert r.status_code == 503 and r.json()["detail"].endswith(
                "; generation 2 is being built beside it (a changed read model, or a rebuild), and readers stay on 1, "
                "which stands still, until it has caught up"
            ), r.text
        # without `after` the same read answers at once, with the rows as they are
        r = await s.client.get(url, params={"account_id": "ryw-1"})
        assert [row["balance"] for row in r.json()["rows"]] == [0]
        # and /metrics says how far it has read, and that it is behind (once the API's
        # history index, its measure of the events there are, has read the deposit)
        deposit = deposited.json()["position"]
        at = {"read_model": BALANCES.model.name, "topic": deposit["topic"], "partition": str(deposit["partition"])}
        history = await s.client.get("/v1/accounts/ryw-1/events", params={"after": token, "wait_ms": 30_000})
        assert history.status_code == 200, history.text
        metrics = (await s.client.get("/metrics")).text
        assert _sample(metrics, "esk_read_model_position", at) < deposit["offset"] <= _sample(metrics, "esk_history_position", at)
        assert _sample(metrics, "esk_read_model_lag", at) >= 1

        # a read that waits while the read model catches up answers once it has
        waiting = asyncio.create_task(s.client.get(url, params={"account_id": "ryw-1", "after": token, "wait_ms": 120_000}, timeout=150))
        await asyncio.sleep(0.5)
        assert not waiting.done()
        await asyncio.to_thread(run, settings, BALANCES, spark=spark)
        r = await asyncio.wait_for(waiting, 30)
        assert r.status_code == 200, r.text
        assert [row["balance"] for row in r.json()["rows"]] == [40]
        reflected = {(p["topic"], p["partition"]): p["offset"] for p in r.json()["positions"]}
        position = deposited.json()["position"]
        assert reflected[position["topic"], position["partition"]] >= position["offset"]
        metrics = (await s.client.get("/metrics")).text
        assert _sample(metrics, "esk_read_model_position", at) >= deposit["offset"]
        assert _sample(metrics, "esk_read_model_lag", at) == 0


def _sample(metrics: str, name: str, labels: dict[str, str]) -> float:
    """The value of `name` whose labels include `labels` (those it has) in Prometheus's text format."""
    for family in text_string_to_metric_families(metrics):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k, v) == v for k, v in labels.items()):
                return sample.value
    raise AssertionError(f"no {name} {labels} in /metrics")


# -- a new user's read model ----------------------------------------------------------


def _counter_totals(events: DataFrame, writer: esk.BatchWriter) -> int:
    added = esk.payload(counters, Added)
    rows = (
        events.filter(esk.of(counters))
        .groupBy(F.col("aggregate_id").alias("counter_id"))
        .agg(F.sum(F.coalesce(added["n"], F.lit(0))).alias("total"), F.max("version").alias("version"))
    )
    return writer.merge(
        rows,
        esk.Merge(
            on="t.counter_id = s.counter_id",
            update={"total": "t.total + s.total", "version": "s.version"},
            update_if="s.version > t.version",
        ),
    )


def _counter_marks(events: DataFrame, writer: esk.BatchWriter) -> int:
    """Columns JSON holds otherwise than Python reads them: a decimal, a map, binary."""
    rows = (
        events.filter(esk.of(counters))
        .groupBy(F.col("aggregate_id").alias("counter_id"))
        .agg(F.max("version").alias("version"))
        .select(
            "counter_id",
            (F.col("version") * F.lit(1.25)).cast("decimal(10,2)").alias("price"),
            F.create_map(F.lit("version"), F.col("version")).alias("marks"),
            F.encode("counter_id", "UTF-8").alias("raw_id"),
        )
    )
    return writer.merge(rows, esk.Merge(on="t.counter_id = s.counter_id", update={"price": "s.price", "marks": "s.marks"}))


USER_READ_MODELS = [
    esk.Projection(
        esk.ReadModel("counter_totals", (counters,), "each counter's total", order_by=("counter_id",)),
        "counter_id STRING, total BIGINT, version BIGINT",
        _counter_totals,
    )
]
MARKS = esk.Projection(
    esk.ReadModel("counter_marks", (counters,), "each counter's marks"),
    "counter_id STRING, price DECIMAL(10,2), marks MAP<STRING,BIGINT>, raw_id BINARY",
    _counter_marks,
)
WITH_MARKS = [*USER_READ_MODELS, MARKS]


def users_settings(settings: Settings, tmp_path: Path, read_models: str = "USER_READ_MODELS", **projections: object) -> Settings:
    """`settings` for the counters and this module's `read_models`, their warehouse in `tmp_path`."""
    users = counters_settings(settings, tmp_path, f"{__name__}:{read_models}", **projections)
    return users.model_copy(update={"api": settings.api.model_copy(update={"read_wait_max_s": 120})})  # a Spark run on a busy machine


async def test_a_users_own_read_model_runs_continuously_and_shows_a_commands_row(
    settings: Settings, spark: SparkSession, tmp_path: Path
) -> None:
    settings = users_settings(settings, tmp_path, "WITH_MARKS")
    [totals] = USER_READ_MODELS
    tables = Tables(settings.projections.warehouse_dir)
    async with system(settings) as s:
        assert (await s.client.post("/v1/counters/c1/start", json={})).status_code == 200
        running = asyncio.create_task(asyncio.to_thread(run, settings, totals, continuous=True, spark=spark))
        try:
            await wait_for(lambda: tables.current_generation("counter_totals") is not None, timeout_s=300, what="the table built")
            for n in (1, 2, 3):
                added = await s.client.post("/v1/counters/c1/add", json={"n": n})
                assert added.status_code == 200, added.text
            token = added.json()["position"]["token"]
            r = await s.client.get(
                "/v1/projections/counter_totals", params={"counter_id": "c1", "after": token, "wait_ms": 120_000}, timeout=150
            )
            assert r.status_code == 200, r.text
            assert r.json()["rows"] == [{"counter_id": "c1", "total": 6, "version": 4}]
            # a decimal answers as its exact text, a map as an object, binary as base64 (the
            # API answered 500 to each), and a decimal filter finds its row
            await asyncio.to_thread(run, settings, MARKS, spark=spark)
            r = await s.client.get("/v1/projections/counter_marks", params={"price": "5.0"})
            assert r.status_code == 200, r.text
            assert r.json()["rows"] == [{"counter_id": "c1", "price": "5.00", "marks": {"version": 4}, "raw_id": "YzE="}]
        finally:
            for query in spark.streams.active:
                query.stop()
            summary = await asyncio.wait_for(running, 120)
    assert summary.events == 4
