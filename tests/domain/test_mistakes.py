"""What a user's decide and evolve get wrong is told as such, naming the function, what it
returned and what it must return; and the processor rejects the command (domain_error)
rather than store events without their state or stop (pure: no Kafka)."""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import pytest
from pydantic import BaseModel

from esk import AggregateType, Command, Event
from esk.processing.command_handler import handle_command
from esk.protocol import CommandEnvelope

T = TypeVar("T")


class Add(Command):
    title: str


class Lend(Command):
    member: str


class Added(Event):
    title: str


class Lent(Event):
    member: str


class Book(BaseModel):
    title: str
    lent_to: str | None = None


def _books(decide: Any = None, evolve: Any = None) -> AggregateType[Book]:
    def right_decide(state: Book | None, command: Command) -> list[Event]:
        return [Added(title=command.title)] if isinstance(command, Add) else [Lent(member=command.member)]  # type: ignore[attr-defined]

    def right_evolve(state: Book | None, event: Event) -> Book:
        if isinstance(event, Added):
            return Book(title=event.title)
        assert state is not None and isinstance(event, Lent)
        return state.model_copy(update={"lent_to": event.member})

    return AggregateType(
        name="books", state=Book, commands={"add": Add, "lend": Lend}, creates=frozenset({Add}), events=[Added, Lent],
        decide=decide or right_decide, evolve=evolve or right_evolve,
    )


@pytest.mark.parametrize(
    ("decided", "told"),
    [
        (lambda state, command: Lent(member="ann"), "books.decide returned Lent for Lend: it returns a list of events, or a Rejection"),
        (lambda state, command: None, "books.decide returned NoneType for Lend: it returns a list of events, or a Rejection"),
        (lambda state, command: "already_lent", "books.decide returned str for Lend: it returns a list of events, or a Rejection"),
        (lambda state, command: [{"member": "ann"}], "books.decide returned a list holding dict: a list of events, or a Rejection"),
    ],
)
def test_a_decide_that_returns_something_else_is_told_so(decided: Any, told: str) -> None:
    books = _books(decide=lambda state, command: [Added(title="t")] if isinstance(command, Add) else decided(state, command))
    with pytest.raises(TypeError, match=f"^{told}$"):
        books.handle(Book(title="t"), Lend(member="ann"))


@pytest.mark.parametrize(("returned", "kind"), [(None, "NoneType"), ({"title": "t"}, "dict")])
def test_an_evolve_that_returns_no_state_rejects_the_command_and_stores_nothing(returned: Any, kind: str) -> None:
    """A forgotten `return` stored the events without the state: the next command wrote the
    same version again. A dict stopped the processor."""

    def evolve(state: Book | None, event: Event) -> Book | None:
        return Book(title="t") if isinstance(event, Added) else returned

    books = _books(evolve=evolve)
    with pytest.raises(TypeError, match=f"^books.evolve returned {kind} for Lent: it returns the state, a Book$"):
        books.fold([Added(title="t"), Lent(member="ann")])
    stored = _stored(books)
    handled = handle_command(books, CommandEnvelope("c2", "books", "b1", "lend", {"member": "ann"}), stored, now=2)
    assert handled.outcome.status == "rejected" and handled.outcome.code == "domain_error"
    assert handled.outcome.detail == f"TypeError: books.evolve returned {kind} for Lent: it returns the state, a Book"
    assert handled.events == [] and handled.aggregate is None


def _stored(books: AggregateType[Book]) -> Any:
    added = handle_command(books, CommandEnvelope("c1", "books", "b1", "add", {"title": "t"}), None, now=1)
    assert added.outcome.status == "accepted" and added.aggregate is not None
    return added.aggregate


@pytest.mark.parametrize(
    ("mistake", "told"),
    [
        ({"commands": [Add, Lend]}, "books: commands= maps each command's name in the URL to its Command class"),
        ({"events": [Added, Lend]}, "books: events= holds what is not an Event class: <class '"),
        ({"events": [Added, Lent, Added]}, r"books: events= names an event type twice: \['Added'\]"),
        ({"state": dict}, "books: state= is the state's model, a pydantic BaseModel class, not <class 'dict'>"),
        ({"creates": frozenset({Added})}, "books: creates= is a frozenset of the Command classes that make an aggregate"),
        ({"decide": "decide"}, "books: decide= is a function, not 'decide'"),
    ],
)
def test_an_aggregate_type_made_wrongly_is_told_by_the_argument_at_fault(mistake: dict[str, Any], told: str) -> None:
    arguments: dict[str, Any] = {
        "name": "books", "state": Book, "commands": {"add": Add, "lend": Lend}, "creates": frozenset({Add}),
        "events": [Added, Lent], "decide": lambda state, command: [], "evolve": lambda state, event: state,
    }
    with pytest.raises((TypeError, ValueError), match=f"^{told}"):
        AggregateType(**(arguments | mistake))


def test_what_decide_and_evolve_may_return_besides_lists_and_the_state_class_itself() -> None:
    """A decide that yields its events, or returns a tuple; an evolve of a generic state
    model that returns the generic class's instance; a retired type that no command makes."""

    def yielding(state: Book | None, command: Command) -> Any:
        yield Added(title="t")

    assert _books(decide=yielding).handle(None, Add(title="t")) == [Added(title="t")]
    assert _books(decide=lambda state, command: (Added(title="t"),)).handle(None, Add(title="t")) == [Added(title="t")]

    class Shelf(BaseModel, Generic[T]):
        item: T

    shelves = AggregateType(
        name="shelves", state=Shelf[str], commands={"add": Add}, creates=frozenset({Add}), events=[Added],
        decide=lambda state, command: [Added(title=command.title)], evolve=lambda state, event: Shelf(item=event.title),
    )
    assert shelves.fold([Added(title="t")]) == Shelf(item="t")
    retired = AggregateType(
        name="retired", state=Book, commands={"add": Add}, creates=frozenset(), events=[Added],
        decide=lambda state, command: [], evolve=lambda state, event: Book(title=event.title),
    )
    assert retired.fold([Added(title="kept readable")]) == Book(title="kept readable")


def test_a_setting_naming_a_list_of_the_wrong_kind_names_the_item_in_a_few_words() -> None:
    """ESK_READ_MODELS pointed at the aggregates' list: each item named by its kind and name,
    not by its repr (over a thousand characters an AggregateType)."""
    from esk.registry import SettingMistake, by_name
    from tests.counters import counters

    with pytest.raises(SettingMistake) as told:
        by_name([counters], "shop:AGGREGATES", str, "a Projection", str, "read model")
    assert str(told.value) == "shop:AGGREGATES holds AggregateType 'counters', not a Projection"
    with pytest.raises(SettingMistake, match=r"^shop:X holds 'x{76}\.\.\., not a Projection$"):
        by_name(["x" * 200], "shop:X", int, "a Projection", str, "read model")
