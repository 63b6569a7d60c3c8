"""Given/when/then for domain tests, with no Kafka and no storage:

    given(accounts, Opened(owner="ada")).when(Withdraw(amount=5)).then_rejected("insufficient_funds")
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .aggregate import AggregateType, Command, Event, Rejection


@dataclass(frozen=True)
class Scenario:
    aggregate: AggregateType[Any]
    history: tuple[Event, ...]

    def when(self, command: Command) -> Outcome:
        before = self.aggregate.fold(self.history)
        return Outcome(self.aggregate, before, self.aggregate.handle(before, command))


@dataclass(frozen=True)
class Outcome:
    aggregate: AggregateType[Any]
    before: Any
    decision: list[Event] | Rejection | Any

    def then(self, *expected: Event) -> Any:
        """Assert the emitted events; return the state after them."""
        assert not isinstance(self.decision, Rejection), f"expected events, got {self.decision}"
        assert list(self.decision) == list(expected), f"expected {list(expected)}, got {list(self.decision)}"
        return self.aggregate.fold(expected, self.before)

    def then_rejected(self, code: str) -> Rejection:
        assert isinstance(self.decision, Rejection), f"expected rejection {code!r}, got {self.decision}"
        assert self.decision.code == code, f"expected rejection {code!r}, got {self.decision.code!r}"
        return self.decision


def given(aggregate: AggregateType[Any], *history: Event) -> Scenario:
    return Scenario(aggregate, tuple(history))
