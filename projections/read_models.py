"""The example's read models. Each is a batch transformation plus how its rows merge in,
written against the domain's own aggregate types and event classes; `READ_MODELS`
registers them, and the default `ESK_READ_MODELS` finds it."""

from __future__ import annotations

from pyspark.sql import Column, DataFrame, Window
from pyspark.sql import functions as F

from domain.accounts import Closed, Deposited, Opened, Withdrawn, accounts
from domain.orders import Cancelled, Deleted, LineAdded, Placed, Shipped, orders
from esk import ENVELOPE, BatchWriter, Merge, Projection, ReadModel, ddl, is_event, of, payload

RECENT_ORDERS = 30


def latest(column: str) -> Column:
    """The value of `column` at the highest version among rows where it is set."""
    return F.max_by(F.col(column), F.when(F.col(column).isNotNull(), F.col("version")))


# -- account_balances ---------------------------------------------------------------


def _account_balances(events: DataFrame, writer: BatchWriter) -> int:
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
    return writer.merge(
        rows,
        Merge(
            on="t.account_id = s.account_id",
            update={
                "balance": "t.balance + s.delta",
                "version": "s.version",
                "owner": "coalesce(s.owner, t.owner)",
                "status": "coalesce(s.status, t.status)",
            },
            update_if="s.version > t.version",
            insert={"account_id": "s.account_id", "owner": "s.owner", "balance": "s.delta", "status": "s.status", "version": "s.version"},
        ),
    )


# -- daily_order_totals ---------------------------------------------------------------


def _order_amounts() -> tuple[Column, Column]:
    placed = payload(orders, Placed)
    added = payload(orders, LineAdded)
    placed_amount = F.aggregate(placed["lines"], F.lit(0).cast("long"), lambda acc, line: acc + line["qty"] * line["price"])
    return placed_amount, added["qty"] * added["price"]


def _daily_order_totals(events: DataFrame, writer: BatchWriter) -> int:
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
    return writer.merge(rows, Merge(on="t.day = s.day", update={"orders": "t.orders + s.orders", "amount": "t.amount + s.amount"}))


# -- customer_recent_orders ------------------------------------------------------------


def _customer_recent_orders(events: DataFrame, writer: BatchWriter) -> int:
    placed_amount, added_amount = _order_amounts()
    placed = payload(orders, Placed)
    status = (
        F.when(is_event(orders, Placed), "placed")
        .when(is_event(orders, Shipped), "shipped")
        .when(is_event(orders, Cancelled), "cancelled")
        .when(is_event(orders, Deleted), "deleted")
    )
    changed = writer.cache(
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
    # One MERGE a batch, the trim included: the orders of the customers this batch placed
    # orders for (as the table has them, with the new ones) are ranked newest first; the
    # source row of an order past RECENT_ORDERS deletes it, or keeps it from coming in.
    new_orders = changed.filter(F.col("customer_id").isNotNull())
    held = writer.lookup(new_orders, "customer_id")
    newest_first = Window.partitionBy("customer_id").orderBy(F.col("placed_at").desc(), F.col("order_id").desc())
    ranked = (
        held.select("customer_id", "order_id", "placed_at")
        .unionByName(new_orders.select("customer_id", "order_id", "placed_at"))
        .withColumn("rank", F.row_number().over(newest_first))
        .select("order_id", "rank")
    )
    pushed_out = ranked.filter(F.col("rank") > RECENT_ORDERS).join(changed, "order_id", "left_anti")
    source = changed.join(ranked, "order_id", "left").unionByName(pushed_out, allowMissingColumns=True)
    return writer.merge(
        source,
        Merge(
            on="t.order_id = s.order_id",
            delete_if=f"s.rank > {RECENT_ORDERS}",
            update={"status": "coalesce(s.status, t.status)", "total": "t.total + s.amount", "version": "s.version"},
            update_if="s.version > t.version",
            # an order trimmed out earlier (no customer_id in this batch) stays out
            insert={
                "customer_id": "s.customer_id",
                "order_id": "s.order_id",
                "placed_at": "s.placed_at",
                "status": "s.status",
                "total": "s.amount",
                "version": "s.version",
            },
            insert_if=f"s.customer_id IS NOT NULL AND s.rank <= {RECENT_ORDERS}",
        ),
    )


# -- events_archive ------------------------------------------------------------------


def _events_archive(events: DataFrame, writer: BatchWriter) -> int:
    rows = events.drop("kafka_partition", "kafka_offset")
    return writer.append(rows)


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
