"""The example's read models. Each is a batch transformation plus how its rows merge in,
written against the domain's own aggregate types and event classes; `READ_MODELS`
registers them, and the default `ESK_READ_MODELS` finds it."""

from __future__ import annotations

from delta.tables import DeltaTable
from pyspark.sql import Column, DataFrame, SparkSession, Window
from pyspark.sql import functions as F

from domain.accounts import Closed, Deposited, Opened, Withdrawn, accounts
from domain.orders import Cancelled, Deleted, LineAdded, Placed, Shipped, orders
from esk.projections.catalog import BatchWriter, Projection, ReadModel
from esk.projections.events import ENVELOPE, ddl, is_event, of, payload

RECENT_ORDERS = 30


def latest(column: str) -> Column:
    """The value of `column` at the highest version among rows where it is set."""
    return F.max_by(F.col(column), F.when(F.col(column).isNotNull(), F.col("version")))


# -- account_balances ---------------------------------------------------------------


def _account_balances(spark: SparkSession, table: DeltaTable, events: DataFrame, writer: BatchWriter) -> int:
    deposited = payload(accounts, Deposited)
    withdrawn = payload(accounts, Withdrawn)
    rows = (
        events.filter(of(accounts))
        .select(
            F.col("aggregate_id").alias("account_id"),
            "version",
            F.coalesce(deposited["amount"], -withdrawn["amount"], F.lit(0)).alias("delta"),
            payload(accounts, Opened)["owner"].alias("owner"),
            F.when(is_event(accounts, Opened), "open").when(is_event(accounts, Closed), "closed").alias("status"),
        )
        .groupBy("account_id")
        .agg(F.sum("delta").alias("delta"), F.max("version").alias("version"), F.max("owner").alias("owner"), latest("status").alias("status"))
    )
    writer.run(
        "merge",
        lambda: table.alias("t")
        .merge(rows.alias("s"), "t.account_id = s.account_id")
        .whenMatchedUpdate(
            condition="s.version > t.version",
            set={
                "balance": "t.balance + s.delta",
                "version": "s.version",
                "owner": "coalesce(s.owner, t.owner)",
                "status": "coalesce(s.status, t.status)",
            },
        )
        .whenNotMatchedInsert(
            values={"account_id": "s.account_id", "owner": "s.owner", "balance": "s.delta", "status": "s.status", "version": "s.version"}
        )
        .execute(),
    )
    return rows.count()


# -- daily_order_totals ---------------------------------------------------------------


def _order_amounts() -> tuple[Column, Column]:
    placed = payload(orders, Placed)
    added = payload(orders, LineAdded)
    placed_amount = F.aggregate(placed["lines"], F.lit(0).cast("long"), lambda acc, line: acc + line["qty"] * line["price"])
    return placed_amount, added["qty"] * added["price"]


def _daily_order_totals(spark: SparkSession, table: DeltaTable, events: DataFrame, writer: BatchWriter) -> int:
    placed_amount, added_amount = _order_amounts()
    rows = (
        events.filter(of(orders))
        .select(
            "day",
            F.when(is_event(orders, Placed), 1).otherwise(0).alias("orders"),
            F.coalesce(placed_amount, added_amount, F.lit(0)).alias("amount"),
        )
        .groupBy("day")
        .agg(F.sum("orders").alias("orders"), F.sum("amount").alias("amount"))
    )
    writer.run(
        "merge",
        lambda: table.alias("t")
        .merge(rows.alias("s"), "t.day = s.day")
        .whenMatchedUpdate(set={"orders": "t.orders + s.orders", "amount": "t.amount + s.amount"})
        .whenNotMatchedInsertAll()
        .execute(),
    )
    return rows.count()


# -- customer_recent_orders ------------------------------------------------------------


def _customer_recent_orders(spark: SparkSession, table: DeltaTable, events: DataFrame, writer: BatchWriter) -> int:
    placed_amount, added_amount = _order_amounts()
    placed = payload(orders, Placed)
    status = (
        F.when(is_event(orders, Placed), "placed")
        .when(is_event(orders, Shipped), "shipped")
        .when(is_event(orders, Cancelled), "cancelled")
        .when(is_event(orders, Deleted), "deleted")
    )
    changed = (
        events.filter(of(orders))
        .select(
            F.col("aggregate_id").alias("order_id"),
            "version",
            placed["customer_id"].alias("customer_id"),
            F.when(is_event(orders, Placed), F.col("event_time")).alias("placed_at"),
            F.coalesce(placed_amount, added_amount, F.lit(0)).alias("amount"),
            status.alias("status"),
        )
        .groupBy("order_id")
        .agg(
            F.max("customer_id").alias("customer_id"),
            F.max("placed_at").alias("placed_at"),
            F.sum("amount").alias("amount"),
            latest("status").alias("status"),
            F.max("version").alias("version"),
        )
    )
    writer.run(
        "merge",
        lambda: table.alias("t")
        .merge(changed.alias("s"), "t.order_id = s.order_id")
        .whenMatchedUpdate(
            condition="s.version > t.version",
            set={"status": "coalesce(s.status, t.status)", "total": "t.total + s.amount", "version": "s.version"},
        )
        .whenNotMatchedInsert(
            condition="s.customer_id IS NOT NULL",  # an order trimmed out earlier stays out
            values={
                "customer_id": "s.customer_id",
                "order_id": "s.order_id",
                "placed_at": "s.placed_at",
                "status": "s.status",
                "total": "s.amount",
                "version": "s.version",
            },
        )
        .execute(),
    )
    # Keep each touched customer's newest RECENT_ORDERS orders. The orders to drop are few
    # (those pushed past the limit by this batch): they are collected, and a batch that
    # pushes none out runs no second MERGE, which would cost its fixed time for nothing.
    customers = changed.filter(F.col("customer_id").isNotNull()).select("customer_id").distinct()
    newest_first = Window.partitionBy("customer_id").orderBy(F.col("placed_at").desc(), F.col("order_id").desc())
    older = [
        row.order_id
        for row in table.toDF()
        .join(customers, "customer_id")
        .withColumn("rank", F.row_number().over(newest_first))
        .filter(F.col("rank") > RECENT_ORDERS)
        .select("order_id")
        .collect()
    ]
    if older:
        trimmed = spark.createDataFrame([(order_id,) for order_id in older], "order_id STRING")
        writer.run(
            "trim",
            lambda: table.alias("t").merge(trimmed.alias("s"), "t.order_id = s.order_id").whenMatchedDelete().execute(),
        )
    return changed.count()


# -- events_archive ------------------------------------------------------------------


def _events_archive(spark: SparkSession, table: DeltaTable, events: DataFrame, writer: BatchWriter) -> int:
    rows = events.drop("kafka_partition", "kafka_offset")
    detail = table.detail().first()
    assert detail is not None, "a Delta table always has its detail row"
    location = detail["location"]
    writer.run(
        "append",
        lambda: rows.write.format("delta")
        .mode("append")
        .option("txnAppId", writer.app_id + ".append")
        .option("txnVersion", writer.batch_id)
        .save(location),
    )
    return events.count()


READ_MODELS: list[Projection] = [
    Projection(
        ReadModel("account_balances", (accounts,), "balance, status and version per account", order_by=("account_id",)),
        "account_id STRING, owner STRING, balance BIGINT, status STRING, version BIGINT",
        _account_balances,
    ),
    Projection(
        ReadModel("daily_order_totals", (orders,), "orders placed and amount per day", order_by=("day",)),
        "day DATE, orders BIGINT, amount BIGINT",
        _daily_order_totals,
    ),
    Projection(
        ReadModel(
            "customer_recent_orders",
            (orders,),
            "each customer's last 30 orders, newest first",
            order_by=("customer_id", "-placed_at", "-order_id"),
        ),
        "customer_id STRING, order_id STRING, placed_at TIMESTAMP, status STRING, total BIGINT, version BIGINT",
        _customer_recent_orders,
    ),
    Projection(
        ReadModel(
            "events_archive",
            (accounts, orders),
            "every event, partitioned by aggregate type and day",
            order_by=("aggregate_type", "aggregate_id", "version"),
            partition_by=("aggregate_type", "day"),
        ),
        f"{ddl(ENVELOPE)}, event_time timestamp, day date",
        _events_archive,
    ),
]
