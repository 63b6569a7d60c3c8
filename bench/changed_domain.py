"""The example domain after a release that changed the accounts state model (a field
added): W3 restarts a processor on it to measure the rebuild of every account's state
from its events (G9)."""

from __future__ import annotations

import dataclasses
from typing import Any

from domain.accounts import Account, accounts
from domain.orders import orders
from esk import AggregateType, Event


class AccountWithNote(Account):
    note: str = ""


def _evolve(state: Account | None, event: Event) -> Account:
    return AccountWithNote.model_validate(accounts.evolve(state, event), from_attributes=True)


AGGREGATES: list[AggregateType[Any]] = [dataclasses.replace(accounts, state=AccountWithNote, evolve=_evolve), orders]
