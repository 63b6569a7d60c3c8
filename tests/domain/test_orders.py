import pytest

from domain.orders import (
    AddLine,
    Cancel,
    Cancelled,
    Delete,
    Deleted,
    Line,
    LineAdded,
    Place,
    Placed,
    Ship,
    Shipped,
    orders,
)
from esk import given

LINES = [Line(sku="apple", qty=2, price=150)]
PLACED = Placed(customer_id="c1", lines=LINES)


def test_place_creates_the_order() -> None:
    state = given(orders).when(Place(customer_id="c1", lines=LINES)).then(PLACED)
    assert state.total == 300 and state.status == "placed"


def test_place_twice_is_already_exists() -> None:
    given(orders, PLACED).when(Place(customer_id="c1", lines=LINES)).then_rejected("already_exists")


def test_commands_on_a_missing_order_are_not_found() -> None:
    given(orders).when(Ship()).then_rejected("not_found")


def test_add_line_grows_the_total() -> None:
    state = given(orders, PLACED).when(AddLine(sku="pear", qty=1, price=99)).then(
        LineAdded(sku="pear", qty=1, price=99)
    )
    assert state.total == 399


def test_ship_then_ship_again_is_rejected() -> None:
    given(orders, PLACED).when(Ship()).then(Shipped())
    given(orders, PLACED, Shipped()).when(Ship()).then_rejected("order_shipped")
    given(orders, PLACED, Shipped()).when(AddLine(sku="x", qty=1, price=1)).then_rejected("order_shipped")
    given(orders, PLACED, Shipped()).when(Cancel()).then_rejected("order_shipped")


@pytest.mark.parametrize("command", [Ship(), AddLine(sku="x", qty=1, price=1), Cancel()])
def test_after_cancel_ship_and_add_line_are_rejected(command: object) -> None:
    given(orders, PLACED, Cancelled()).when(command).then_rejected("order_cancelled")  # type: ignore[arg-type]


@pytest.mark.parametrize("command", [Ship(), AddLine(sku="x", qty=1, price=1), Cancel(), Delete()])
def test_every_command_after_delete_is_rejected(command: object) -> None:
    given(orders, PLACED, Deleted()).when(command).then_rejected("order_deleted")  # type: ignore[arg-type]


def test_a_cancelled_order_can_be_deleted() -> None:
    state = given(orders, PLACED, Cancelled()).when(Delete()).then(Deleted())
    assert state.status == "deleted"


@pytest.mark.parametrize(
    "payload",
    [
        {"customer_id": "c", "lines": []},
        {"customer_id": "", "lines": [{"sku": "a", "qty": 1, "price": 1}]},
        {"customer_id": "c", "lines": [{"sku": "a", "qty": 0, "price": 1}]},
        {"customer_id": "c", "lines": [{"sku": "a", "qty": 1, "price": -1}]},
        {"customer_id": "c", "lines": [{"sku": "a", "qty": 1, "price": 1, "color": "red"}]},
    ],
)
def test_invalid_place_payloads(payload: dict[str, object]) -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError):
        orders.parse_command("place", payload)
