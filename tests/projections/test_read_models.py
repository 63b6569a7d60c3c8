"""Each shipped projection, fed by events produced through the real command path on the
real broker, equals a reference computed in plain Python from the same events; a re-run
after an interrupted batch and a rebuild give the same tables."""

from __future__ import annotations

import random
import shutil
import uuid
from collections import defaultdict
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

pyspark = pytest.importorskip("pyspark")

from aiokafka import AIOKafkaProducer  # noqa: E402
from pyspark.sql import SparkSession  # noqa: E402

from esk.kafka.topics import TopicNames  # noqa: E402
from esk.projections.catalog import Tables  # noqa: E402
from esk.projections.runner import run  # noqa: E402
from esk.settings import Settings  # noqa: E402
from projections.read_models import READ_MODELS, RECENT_ORDERS  # noqa: E402
from tests.system import events_topic, read_topic, system  # noqa: E402

PROJECTIONS = {p.model.name: p for p in READ_MODELS}

pytestmark = [pytest.mark.kafka, pytest.mark.spark]


async def _drive(settings: Settings) -> None:
    """Commands through the API and the processor: accounts and orders, with rejections."""
    rng = random.Random(11)
    async with system(settings) as s:
        c = s.client
        for n in range(12):
            account = f"acc-{n}"
            assert (await c.post(f"/v1/accounts/{account}/open", json={"owner": f"owner-{n}"})).status_code == 200
            for _ in range(rng.randint(1, 6)):
                await c.post(f"/v1/accounts/{account}/{rng.choice(['deposit', 'withdraw'])}", json={"amount": rng.randint(1, 90)})
        balance = (await c.get("/v1/accounts/acc-0")).json()["state"]["balance"]
        if balance:
            await c.post("/v1/accounts/acc-0/withdraw", json={"amount": balance})
        assert (await c.post("/v1/accounts/acc-0/close", json={})).status_code == 200

        customers = [f"cust-{n}" for n in range(4)]
        for n in range(90):  # cust-0 gets more than RECENT_ORDERS orders
            customer = customers[0] if n % 2 else rng.choice(customers)
            order = f"ord-{n:03d}"
            lines = [{"sku": f"sku-{k}", "qty": rng.randint(1, 3), "price": rng.randint(100, 900)} for k in range(rng.randint(1, 3))]
            assert (await c.post(f"/v1/orders/{order}/place", json={"customer_id": customer, "lines": lines})).status_code == 200
            follow_up = rng.choice(["add-line", "ship", "cancel", "delete", None])
            if follow_up == "add-line":
                await c.post(f"/v1/orders/{order}/add-line", json={"sku": "extra", "qty": 1, "price": 50})
            elif follow_up:
                await c.post(f"/v1/orders/{order}/{follow_up}", json={})


def _events(records: list[Any]) -> list[dict[str, Any]]:
    return [v for _, v, _ in records]


def _day(ms: int) -> Any:
    return datetime.fromtimestamp(ms / 1000, tz=UTC).date()


def reference_account_balances(events: list[dict[str, Any]]) -> dict[str, tuple[Any, ...]]:
    out: dict[str, list[Any]] = {}
    for e in sorted(events, key=lambda e: (e["aggregate_id"], e["version"])):
        row = out.setdefault(e["aggregate_id"], [None, 0, None, 0])
        if e["type"] == "Opened":
            row[0], row[2] = e["data"].get("owner", e["data"].get("name")), "open"
        elif e["type"] == "Deposited":
            row[1] += e["data"]["amount"]
        elif e["type"] == "Withdrawn":
            row[1] -= e["data"]["amount"]
        elif e["type"] == "Closed":
            row[2] = "closed"
        row[3] = e["version"]
    return {k: tuple(v) for k, v in out.items()}


def _amount(e: dict[str, Any]) -> int:
    if e["type"] == "Placed":
        return sum(line["qty"] * line["price"] for line in e["data"]["lines"])
    if e["type"] == "LineAdded":
        return int(e["data"]["qty"] * e["data"]["price"])
    return 0


def reference_daily_order_totals(events: list[dict[str, Any]]) -> dict[Any, tuple[int, int]]:
    totals: dict[Any, list[int]] = defaultdict(lambda: [0, 0])
    for e in events:
        day = totals[_day(e["recorded_at"])]
        day[0] += e["type"] == "Placed"
        day[1] += _amount(e)
    return {k: tuple(v) for k, v in totals.items()}  # type: ignore[misc]


def reference_customer_recent_orders(events: list[dict[str, Any]]) -> dict[str, list[tuple[Any, ...]]]:
    orders: dict[str, dict[str, Any]] = {}
    statuses = {"Placed": "placed", "Shipped": "shipped", "Cancelled": "cancelled", "Deleted": "deleted"}
    for e in sorted(events, key=lambda e: (e["aggregate_id"], e["version"])):
        order = orders.setdefault(e["aggregate_id"], {"total": 0})
        if e["type"] == "Placed":
            order |= {"customer_id": e["data"]["customer_id"], "placed_at": e["recorded_at"]}
        order["total"] += _amount(e)
        order["status"] = statuses.get(e["type"], order.get("status"))
        order["version"] = e["version"]
    by_customer: dict[str, list[tuple[Any, ...]]] = defaultdict(list)
    for order_id, o in orders.items():
        by_customer[o["customer_id"]].append((order_id, o["placed_at"], o["status"], o["total"], o["version"]))
    return {
        customer: sorted(rows, key=lambda r: (r[1], r[0]), reverse=True)[:RECENT_ORDERS]
        for customer, rows in by_customer.items()
    }


def _table(spark: SparkSession, settings: Settings, name: str) -> list[Any]:
    path = Tables(settings.projections.warehouse_dir).current_path(name)
    assert path is not None
    return spark.read.format("delta").load(str(path)).collect()


def _check_all(spark: SparkSession, settings: Settings, accounts: list[dict[str, Any]], orders: list[dict[str, Any]]) -> None:
    balances = {r.account_id: (r.owner, r.balance, r.status, r.version) for r in _table(spark, settings, "account_balances")}
    assert balances == reference_account_balances(accounts)

    totals = {r.day: (r.orders, r.amount) for r in _table(spark, settings, "daily_order_totals")}
    assert totals == reference_daily_order_totals(orders)

    recent: dict[str, list[tuple[Any, ...]]] = defaultdict(list)
    for r in _table(spark, settings, "customer_recent_orders"):
        placed_ms = int(r.placed_at.replace(tzinfo=UTC).timestamp() * 1000)
        recent[r.customer_id].append((r.order_id, placed_ms, r.status, r.total, r.version))
    expected = reference_customer_recent_orders(orders)
    assert {c: sorted(rows, key=lambda x: (x[1], x[0]), reverse=True) for c, rows in recent.items()} == expected
    assert max(len(rows) for rows in recent.values()) == RECENT_ORDERS

    archive = _table(spark, settings, "events_archive")
    assert sorted((r.event_id, r.version) for r in archive) == sorted(
        (e["event_id"], e["version"]) for e in accounts + orders
    )


# Spark in local mode on two cores: about four minutes alone, more on a busy machine.
@pytest.mark.timeout(900)
async def test_projections_equal_their_python_references(
    settings: Settings, spark: SparkSession, tmp_path: Path, runner_said: Callable[[], str]
) -> None:
    settings = settings.model_copy(
        update={"projections": settings.projections.model_copy(update={"warehouse_dir": tmp_path / "warehouse", "max_offsets_per_trigger": 80})}
    )
    await _drive(settings)
    # An event written by an older release (Opened v1 said "name"): the domain's upcaster applies.
    producer = AIOKafkaProducer(bootstrap_servers=settings.bootstrap_servers, transactional_id=f"legacy-{uuid.uuid4()}")
    await producer.start()
    async with producer.transaction():
        legacy = {
            "event_id": "accounts/legacy/1", "aggregate_type": "accounts", "aggregate_id": "legacy", "version": 1,
            "type": "Opened", "schema_version": 1, "data": {"name": "old-timer"}, "command_id": "x",
            "correlation_id": "x", "causation_id": "x", "recorded_at": 1_700_000_000_000,
        }
        import orjson

        await producer.send_and_wait(TopicNames(settings.app).events("accounts"), orjson.dumps(legacy), key=b"legacy")
    await producer.stop()

    accounts = _events(await read_topic(settings, events_topic(settings, "accounts")))
    orders = _events(await read_topic(settings, events_topic(settings, "orders")))
    for name, projection in PROJECTIONS.items():
        summary = run(settings, projection, spark=spark)
        assert summary.events == len(accounts if name == "account_balances" else orders if name != "events_archive" else accounts + orders)
        if "orders" in projection.model.categories:
            assert summary.batches > 1  # several micro-batches: the merges compose across batches
    _check_all(spark, settings, accounts, orders)
    assert ("old-timer", 0, "open", 1) in reference_account_balances(accounts).values()
    # decoded once, in the read model's job, until the older event turns up there: its batch
    # is applied again, upcast (the row above), and every later batch counts versions first
    assert "holds events of another schema version than this code's" in runner_said()

    # A crash after a batch's Delta commit, before Spark recorded the batch as done: the
    # batch runs again with the same id, and Delta's txnAppId/txnVersion makes it a no-op.
    tables = Tables(settings.projections.warehouse_dir)
    for name, projection in PROJECTIONS.items():
        commits = tables.checkpoint(name, 1) / "commits"
        last = max(commits.iterdir(), key=lambda p: int(p.name) if p.name.isdigit() else -1)
        last.unlink()
        (commits / f".{last.name}.crc").unlink(missing_ok=True)
        summary = run(settings, projection, spark=spark)
        assert summary.batches == 1 and summary.events > 0  # it really ran again
    _check_all(spark, settings, accounts, orders)

    # The API serves read models from the Delta tables, without Spark (histories it serves
    # from its own index of the events topics: tests/api/test_history.py).
    async with system(settings, processors=0) as s:
        r = await s.client.get("/v1/projections/customer_recent_orders", params={"customer_id": "cust-0"})
        assert r.status_code == 200
        rows = r.json()["rows"]
        assert [row["order_id"] for row in rows] == [o[0] for o in reference_customer_recent_orders(orders)["cust-0"]]
        assert r.json()["more"] is False and len(rows) > 1
        r = await s.client.get("/v1/projections/customer_recent_orders", params={"customer_id": "cust-0", "limit": 1})
        assert (r.json()["count"], r.json()["more"]) == (1, True)  # the limit cut some: said so
        r = await s.client.get("/v1/projections/account_balances", params={"account_id": "acc-0"})
        assert r.json()["rows"][0]["status"] == "closed"
        r = await s.client.get("/v1/projections/daily_order_totals", params={"orders": "abc"})
        assert r.status_code == 400 and r.json()["code"] == "invalid_filter"
        r = await s.client.get("/v1/projections/nope")
        assert r.status_code == 404 and r.json()["code"] == "unknown_projection"
        assert r.json()["detail"].startswith(
            "no read model 'nope'; this API knows account_balances, customer_recent_orders, daily_order_totals, events_archive ("
        )

    # Rebuild: a fresh generation from the earliest offsets, switched to once caught up.
    # The batches above were small enough for delta-rs on the driver; these are written by
    # Spark's MERGE (`driver_write_max_events` 0), and must make the same tables: in fewer,
    # bigger batches (a MERGE costs seconds), still more than one for the orders.
    by_spark = settings.model_copy(
        update={"projections": settings.projections.model_copy(update={"driver_write_max_events": 0, "max_offsets_per_trigger": 250})}
    )
    for name, projection in PROJECTIONS.items():
        before = sorted(tuple(r) for r in _table(spark, settings, name))
        summary = run(by_spark, projection, rebuild=True, spark=spark)
        assert summary.generation == 2 and tables.current_generation(name) == 2
        if "orders" in projection.model.categories:
            assert summary.batches > 1
        assert sorted(tuple(r) for r in _table(spark, settings, name)) == before
    shutil.rmtree(settings.projections.warehouse_dir)
