"""What a subscription is, as a user's code declares it: a name, the aggregate types whose
events it reads, and one `async` handler per event class.

    payments = Reactor("payments", reads=[orders])

    @payments.on(Placed)
    async def charge(event: Placed, ctx: Context) -> list[Send]:
        return [Send(accounts, event.pay_from, Withdraw(amount=...))]

Three kinds, by where the handler's effects go and so how exactly-once is kept:
- `Reactor`: handlers return commands; they go to the commands topic in one Kafka
  transaction with the subscription's offsets. A reactor can also handle the outcome of a
  command it sent (`on_outcome`).
- `DatabaseHandler`: handlers write to the subscription's database (`ctx.db`); its
  offsets live in that database and move in the same transaction as the writes.
- `SideEffectHandler`: anything else (mail, HTTP calls); at least once, offsets committed
  to Kafka after the handler; `ctx.idempotency_key` names the event for the other side.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, ClassVar, Generic, TypeVar

from ..domain.aggregate import AggregateType, Command, Event
from .database import DatabaseConfig, Sql


class Kind(StrEnum):
    REACTOR = "reactor"
    DATABASE = "database"
    SIDE_EFFECT = "side_effect"


@dataclass(frozen=True, slots=True)
class Context:
    """Where an event comes from, given to its handler with it."""

    subscription: str
    aggregate_type: str
    aggregate_id: str
    version: int
    event_id: str
    correlation_id: str
    causation_id: str  # the command that emitted the event
    topic: str
    partition: int
    offset: int
    # True while the subscription handles again events it had handled before a reset.
    replaying: bool

    @property
    def idempotency_key(self) -> str:
        """The same for every delivery of this event to this subscription, and another for
        any other event, that of an aggregate created anew after it expired included."""
        return f"{self.subscription}:{event_key(self.event_id, self.partition, self.offset)}"


def event_key(event_id: str, partition: int, offset: int) -> str:
    """An event's id with its place on its topic: an event id (`<type>/<id>/<version>`) is
    used again by an aggregate created anew after it expired, and its place is not."""
    return f"{event_id}@{partition}.{offset}"


@dataclass(frozen=True, slots=True)
class DatabaseContext(Context):
    db: Sql  # the subscription's database, inside the transaction that also moves its offsets


@dataclass(frozen=True, slots=True)
class Origin:
    """The event a reactor's command was derived from."""

    event_id: str
    aggregate_type: str
    aggregate_id: str
    version: int


@dataclass(frozen=True, slots=True)
class CommandOutcome:
    """What became of a command a reactor sent: accepted, or refused with a code."""

    command_id: str
    aggregate_type: str
    aggregate_id: str
    command: str  # its name, as in the HTTP API
    status: str  # "accepted", "rejected" or "precondition_failed"
    version: int
    code: str | None
    detail: str | None
    # The event the command was sent for. None only for an id under the subscription's
    # prefix that names no event: one that code other than esk's made up.
    origin: Origin | None

    @property
    def accepted(self) -> bool:
        return self.status == "accepted"


@dataclass(frozen=True, slots=True)
class OutcomeContext:
    subscription: str
    topic: str
    partition: int
    offset: int
    replaying: bool


@dataclass(frozen=True)
class Send:
    """A command a reactor sends. Its id is derived from what the reactor was handling, so
    handling that again (a crash, a replay) sends a command the processor has seen."""

    aggregate_type: AggregateType[Any]
    aggregate_id: str
    command: Command
    expected_version: int | None = None

    @property
    def command_name(self) -> str:
        for name, command_type in self.aggregate_type.commands.items():
            if command_type is type(self.command):
                return name
        raise TypeError(f"{type(self.command).__name__} is not a command of {self.aggregate_type.name}")


@dataclass(frozen=True)
class Retries:
    """How a failing handler is tried again before its event is parked: `attempts` in all,
    waiting `first_delay_s`, then twice as long each time, at most `max_delay_s`."""

    attempts: int = 5
    first_delay_s: float = 0.2
    max_delay_s: float = 30.0

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError("Retries.attempts must be at least 1")

    def delay_s(self, failed_attempts: int) -> float:
        """The wait after the `failed_attempts`-th failure."""
        return float(min(self.max_delay_s, self.first_delay_s * 2 ** (failed_attempts - 1)))


E = TypeVar("E", bound=Event)
C = TypeVar("C")  # the context a kind's handlers get
R = TypeVar("R")  # what a kind's handlers return
H = TypeVar("H", bound=Callable[..., Any])
EventHandler = Callable[[E, C], Awaitable[R]]
OutcomeHandler = Callable[[CommandOutcome, OutcomeContext], Awaitable[Sequence[Send]]]


def check_name(name: str, what: str) -> None:
    # Names go into consumer group ids, transactional ids, topic names and SQL values.
    if not name or not name.replace("_", "").replace("-", "").isalnum():
        raise ValueError(f"{what} name {name!r} must be alphanumeric (with - or _)")


@dataclass(eq=False, repr=False)
class Subscription(Generic[C, R]):
    name: str
    reads: Sequence[AggregateType[Any]]
    retries: Retries = field(default_factory=Retries)
    handlers: dict[type[Event], Callable[[Any, Any], Awaitable[Any]]] = field(init=False, default_factory=dict)

    kind: ClassVar[Kind]

    def __post_init__(self) -> None:
        check_name(self.name, "subscription")
        self.reads = tuple(self.reads)
        if not self.reads:
            raise ValueError(f"subscription {self.name!r} reads no aggregate type")
        for aggregate in self.reads:
            if not isinstance(aggregate, AggregateType):
                raise TypeError(f"subscription {self.name!r}: reads holds {aggregate!r}, not an AggregateType")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, reads=[{', '.join(a.name for a in self.reads)}])"

    def on(self, event_type: type[E]) -> Callable[[EventHandler[E, C, R]], EventHandler[E, C, R]]:
        """Register the decorated `async def handler(event, ctx)` for `event_type`."""
        self.aggregate_of(event_type)
        if event_type in self.handlers:
            raise ValueError(f"subscription {self.name!r} handles {event_type.__name__} twice")

        def register(handler: EventHandler[E, C, R]) -> EventHandler[E, C, R]:
            self.handlers[event_type] = _awaitable(handler, f"subscription {self.name!r}: the handler of {event_type.__name__}")
            return handler

        return register

    def aggregate_of(self, event_type: type[Event]) -> AggregateType[Any]:
        for aggregate in self.reads:
            if event_type in aggregate.events:
                return aggregate
        read = ", ".join(a.name for a in self.reads)
        raise ValueError(f"subscription {self.name!r} reads {read}: none of them has the event {event_type.__name__}")


@dataclass(eq=False, repr=False)
class Reactor(Subscription[Context, Sequence[Send]]):
    """Handlers return the commands to send (a saga, a process manager); exactly once."""

    outcome_handlers: dict[type[Command], OutcomeHandler] = field(init=False, default_factory=dict)

    kind: ClassVar[Kind] = Kind.REACTOR

    def on_outcome(self, command_type: type[Command]) -> Callable[[OutcomeHandler], OutcomeHandler]:
        """Register the decorated `async def handler(outcome, ctx)` for the outcomes of the
        `command_type` commands this reactor sent (from `<app>.results`)."""
        if not (isinstance(command_type, type) and issubclass(command_type, Command)):
            raise TypeError(f"on_outcome takes a Command class, not {command_type!r}")
        if command_type in self.outcome_handlers:
            raise ValueError(f"subscription {self.name!r} handles the outcome of {command_type.__name__} twice")

        def register(handler: OutcomeHandler) -> OutcomeHandler:
            self.outcome_handlers[command_type] = _awaitable(handler, f"subscription {self.name!r}: the outcome handler of {command_type.__name__}")
            return handler

        return register


@dataclass(eq=False, repr=False)
class DatabaseHandler(Subscription[DatabaseContext, None]):
    """Handlers write to `ctx.db`; the subscription's offsets move in the same transaction.

    `database`: None is SQLite in the subscriber's data directory. `schema`: statements run
    (in one transaction) each time the subscription starts, e.g. CREATE TABLE IF NOT EXISTS.
    `on_reset`: run by `esk subscriptions reset` in the transaction that rewinds the
    offsets (e.g. empty the tables the replay fills again)."""

    database: DatabaseConfig | None = None
    schema: Sequence[str] = ()
    on_reset: Callable[[Sql], Awaitable[None]] | None = None

    kind: ClassVar[Kind] = Kind.DATABASE


@dataclass(eq=False, repr=False)
class SideEffectHandler(Subscription[Context, None]):
    """Handlers act outside any database esk knows; at least once, so a handler may see an
    event again after a crash: `ctx.idempotency_key` lets the other side tell."""

    kind: ClassVar[Kind] = Kind.SIDE_EFFECT


AnySubscription = Subscription[Any, Any]


def _awaitable(handler: H, what: str) -> H:
    """`handler`, once it is known to be an `async def`, or a decorator's wrapper of one
    (`functools.wraps`), or a callable whose `__call__` is: a plain `def` would fail every
    event it is given, each retried and then parked."""
    unwrapped = inspect.unwrap(handler)
    if inspect.iscoroutinefunction(unwrapped) or inspect.iscoroutinefunction(type(unwrapped).__call__):
        return handler
    raise TypeError(f"{what} must be an `async def`, not {handler!r}")
