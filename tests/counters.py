"""A small domain of a user's own, as the tests that run esk for one write it: counters that
start and add, with an event at its second schema version (v1 said "amount"), upcast."""

from __future__ import annotations

from pydantic import BaseModel, Field

from esk import AggregateType, Command, Decision, Event


class Start(Command):
    pass


class Add(Command):
    n: int = Field(gt=0)


class Started(Event):
    pass


class Added(Event):
    schema_version = 2  # v1 said "amount"
    n: int


class Counter(BaseModel):
    total: int = 0


def decide(state: Counter | None, command: Command) -> Decision:
    return [Added(n=command.n)] if isinstance(command, Add) else [Started()]


def evolve(state: Counter | None, event: Event) -> Counter:
    if isinstance(event, Added):
        assert state is not None
        return Counter(total=state.total + event.n)
    return Counter()


counters = AggregateType(
    name="counters", state=Counter, commands={"start": Start, "add": Add}, creates=frozenset({Start}),
    events=[Started, Added], decide=decide, evolve=evolve, upcasters={("Added", 1): lambda v1: {"n": v1["amount"]}},
)
AGGREGATES = [counters]
