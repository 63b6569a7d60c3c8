"""`customer_ledger`: per customer, the number of orders placed and their total amount (lines
added later included), in the subscription's own SQLite database, exactly once.

    SELECT customer_id, orders, total FROM customer_ledger
"""

from __future__ import annotations

from domain.orders import LineAdded, Placed, orders
from esk import DatabaseContext, DatabaseHandler, Sql

SCHEMA = (
    "CREATE TABLE IF NOT EXISTS customer_ledger (customer_id TEXT PRIMARY KEY, orders INTEGER NOT NULL, total INTEGER NOT NULL)",
    # Which customer an order is for: a LineAdded event names only its order.
    "CREATE TABLE IF NOT EXISTS customer_ledger_orders (order_id TEXT PRIMARY KEY, customer_id TEXT NOT NULL)",
)


async def start_over(db: Sql) -> None:
    """`esk subscriptions reset customer_ledger`: the replay fills the tables again."""
    await db.execute("DELETE FROM customer_ledger")
    await db.execute("DELETE FROM customer_ledger_orders")


customer_ledger = DatabaseHandler("customer_ledger", reads=[orders], schema=SCHEMA, on_reset=start_over)


@customer_ledger.on(Placed)
async def placed(event: Placed, ctx: DatabaseContext) -> None:
    await ctx.db.execute(
        "INSERT INTO customer_ledger_orders (order_id, customer_id) VALUES (?, ?) "
        "ON CONFLICT (order_id) DO UPDATE SET customer_id = excluded.customer_id",  # an expired order's id, placed anew
        (ctx.aggregate_id, event.customer_id),
    )
    await ctx.db.execute(
        "INSERT INTO customer_ledger (customer_id, orders, total) VALUES (?, 1, ?) "
        "ON CONFLICT (customer_id) DO UPDATE SET orders = orders + 1, total = total + excluded.total",
        (event.customer_id, event.total),
    )


@customer_ledger.on(LineAdded)
async def line_added(event: LineAdded, ctx: DatabaseContext) -> None:
    row = await ctx.db.fetchone("SELECT customer_id FROM customer_ledger_orders WHERE order_id = ?", (ctx.aggregate_id,))
    if row is None:
        raise LookupError(f"order {ctx.aggregate_id} was never placed")
    await ctx.db.execute("UPDATE customer_ledger SET total = total + ? WHERE customer_id = ?", (event.qty * event.price, row[0]))
