"""Example domain: customer orders. Prices are integers in minor units (cents)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Literal

from pydantic import BaseModel, Field

from esk import AggregateType, Command, Decision, Event, Rejection


class Line(BaseModel):
    model_config = {"extra": "forbid", "frozen": True}
    sku: str = Field(min_length=1, max_length=100)
    qty: int = Field(gt=0, le=100_000)
    price: int = Field(ge=0, le=10**9)


# -- commands --------------------------------------------------------------------
class Place(Command):
    customer_id: str = Field(min_length=1, max_length=200)
    lines: list[Line] = Field(min_length=1, max_length=200)
    # The account the order is paid from (the `payments` subscription withdraws its total,
    # or cancels the order if it cannot); None: paid some other way.
    pay_from: str | None = Field(default=None, min_length=1, max_length=200)


class AddLine(Command):
    sku: str = Field(min_length=1, max_length=100)
    qty: int = Field(gt=0, le=100_000)
    price: int = Field(ge=0, le=10**9)


class Ship(Command):
    pass


class Cancel(Command):
    pass


class Delete(Command):
    pass


# -- events ----------------------------------------------------------------------
class Placed(Event):
    # v2 added `pay_from`; a v1 event (paid some other way) reads as None: `_placed_v1_to_v2`.
    schema_version = 2
    customer_id: str
    lines: list[Line]
    pay_from: str | None = None

    @property
    def total(self) -> int:
        return sum(line.qty * line.price for line in self.lines)


class LineAdded(Event):
    sku: str
    qty: int
    price: int


class Shipped(Event):
    pass


class Cancelled(Event):
    pass


class Deleted(Event):
    pass


# -- state -----------------------------------------------------------------------
class Order(BaseModel):
    customer_id: str
    lines: list[Line]
    status: Literal["placed", "shipped", "cancelled", "deleted"] = "placed"

    @property
    def total(self) -> int:
        return sum(line.qty * line.price for line in self.lines)


def decide(state: Order | None, command: Command) -> Decision:
    match command:
        case Place(customer_id=customer_id, lines=lines, pay_from=pay_from):
            return [Placed(customer_id=customer_id, lines=lines, pay_from=pay_from)]
    assert state is not None  # the lifecycle rules only let Place through on a new order
    if state.status == "deleted":
        return Rejection("order_deleted", "the order was deleted")
    match command:
        case AddLine(sku=sku, qty=qty, price=price):
            if state.status == "cancelled":
                return Rejection("order_cancelled", "the order was cancelled")
            if state.status == "shipped":
                return Rejection("order_shipped", "the order has shipped")
            return [LineAdded(sku=sku, qty=qty, price=price)]
        case Ship():
            if state.status == "cancelled":
                return Rejection("order_cancelled", "the order was cancelled")
            if state.status == "shipped":
                return Rejection("order_shipped", "the order has shipped already")
            return [Shipped()]
        case Cancel():
            if state.status == "shipped":
                return Rejection("order_shipped", "a shipped order cannot be cancelled")
            if state.status == "cancelled":
                return Rejection("order_cancelled", "the order was cancelled already")
            return [Cancelled()]
        case Delete():
            return [Deleted()]
    raise TypeError(f"unhandled command {command!r}")


def evolve(state: Order | None, event: Event) -> Order:
    match event:
        case Placed(customer_id=customer_id, lines=lines):
            return Order(customer_id=customer_id, lines=list(lines))
    assert state is not None
    match event:
        case LineAdded(sku=sku, qty=qty, price=price):
            return state.model_copy(update={"lines": [*state.lines, Line(sku=sku, qty=qty, price=price)]})
        case Shipped():
            return state.model_copy(update={"status": "shipped"})
        case Cancelled():
            return state.model_copy(update={"status": "cancelled"})
        case Deleted():
            return state.model_copy(update={"status": "deleted"})
    raise TypeError(f"unhandled event {event!r}")


def _placed_v1_to_v2(data: dict[str, Any]) -> dict[str, Any]:
    return {**data, "pay_from": None}


orders: AggregateType[Order] = AggregateType(
    name="orders",
    state=Order,
    commands={"place": Place, "add-line": AddLine, "ship": Ship, "cancel": Cancel, "delete": Delete},
    creates=frozenset({Place}),
    events=[Placed, LineAdded, Shipped, Cancelled, Deleted],
    decide=decide,
    evolve=evolve,
    upcasters={("Placed", 1): _placed_v1_to_v2},
    retention=timedelta(days=90),
    is_final=lambda order: order.status == "deleted",
)
