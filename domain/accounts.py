"""Example domain: bank accounts. Amounts are integers in minor units (cents)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Literal

from pydantic import BaseModel, Field

from esk import AggregateType, Command, Decision, Event, Rejection

Amount = Field(gt=0, le=10**12)  # at most 10 billion in major units: fits a 64-bit long everywhere


# -- commands --------------------------------------------------------------------
class Open(Command):
    owner: str = Field(min_length=1, max_length=200)


class Deposit(Command):
    amount: int = Amount


class Withdraw(Command):
    amount: int = Amount


class Close(Command):
    pass


# -- events ----------------------------------------------------------------------
class Opened(Event):
    # v1 called the owner "name"; see `_opened_v1_to_v2`.
    schema_version = 2
    owner: str


class Deposited(Event):
    amount: int


class Withdrawn(Event):
    amount: int


class Closed(Event):
    pass


# -- state -----------------------------------------------------------------------
class Account(BaseModel):
    owner: str
    # Gained in a later release (no default: a stored state from before cannot be read as
    # this model). esk rebuilds those states from the events, where `evolve` counts them.
    movements: int
    balance: int = 0
    status: Literal["open", "closed"] = "open"


def decide(state: Account | None, command: Command) -> Decision:
    match command:
        case Open(owner=owner):
            return [Opened(owner=owner)]
    assert state is not None  # the lifecycle rules only let Open through on a new account
    if state.status == "closed":
        return Rejection("account_closed", "the account is closed")
    match command:
        case Deposit(amount=amount):
            return [Deposited(amount=amount)]
        case Withdraw(amount=amount):
            if amount > state.balance:
                return Rejection(
                    "insufficient_funds", f"cannot withdraw {amount}: the balance is {state.balance}"
                )
            return [Withdrawn(amount=amount)]
        case Close():
            if state.balance != 0:
                return Rejection("balance_not_zero", f"the balance is {state.balance}, not 0")
            return [Closed()]
    raise TypeError(f"unhandled command {command!r}")


def evolve(state: Account | None, event: Event) -> Account:
    match event:
        case Opened(owner=owner):
            return Account(owner=owner, movements=0)
    assert state is not None
    match event:
        case Deposited(amount=amount):
            return state.model_copy(update={"balance": state.balance + amount, "movements": state.movements + 1})
        case Withdrawn(amount=amount):
            return state.model_copy(update={"balance": state.balance - amount, "movements": state.movements + 1})
        case Closed():
            return state.model_copy(update={"status": "closed"})
    raise TypeError(f"unhandled event {event!r}")


def _opened_v1_to_v2(data: dict[str, Any]) -> dict[str, Any]:
    rest = {k: v for k, v in data.items() if k != "name"}
    return {**rest, "owner": data["name"]}


accounts: AggregateType[Account] = AggregateType(
    name="accounts",
    state=Account,
    commands={"open": Open, "deposit": Deposit, "withdraw": Withdraw, "close": Close},
    creates=frozenset({Open}),
    events=[Opened, Deposited, Withdrawn, Closed],
    decide=decide,
    evolve=evolve,
    upcasters={("Opened", 1): _opened_v1_to_v2},
    retention=timedelta(days=30),
    is_final=lambda account: account.status == "closed",
)
