"""Which handler a record goes to, decided before its payload is decoded, and the record
decoded for it.

An event's type is in its `esk-event-type` header: a record of a type the subscription does
not handle is passed over without decoding it (of a type the code knows: one it does not
is newer code's, and parked for it). On `<app>.results` a reactor reads only the
outcomes of its own commands, whose ids begin with `<subscription>:`; the id is the first
field of an encoded Outcome (protocol.py encodes a record's fields in their declared
order), so that is a prefix test on the raw bytes too.

The commands a reactor sends get ids derived from what it was handling:
`<subscription>:<event id>@<partition>.<offset>:<n>` (the n-th command of that handler
call; the event's place as well as its id, which an aggregate created anew after it
expired uses again), and from an
outcome `<subscription>:<that command's id>:<n>`. Handling the same event again, after a
crash or in a replay, sends the same ids, and the processor answers a command id it has
seen with its first outcome.
"""

from __future__ import annotations

import re
import reprlib
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from aiokafka.structs import ConsumerRecord

from ..domain.aggregate import AggregateType, Event, NewerSchemaVersion, one_line
from ..kafka.topics import TopicNames
from ..protocol import CommandEnvelope, DecodeError, EventRecord, Outcome
from .api import AnySubscription, CommandOutcome, Context, DatabaseContext, Origin, OutcomeContext, Reactor, Send, event_key
from .parking import header

Handler = Callable[[Any, Any], Awaitable[Any]]


class Undecodable(Exception):
    """A record routed to a handler that cannot be made into what the handler takes."""


class HandlerMistake(TypeError):
    """A handler answered what its kind cannot take: the same code answers the same again,
    so the event is parked at once, not tried again."""


@dataclass(frozen=True, slots=True)
class EventRoute:
    aggregate: AggregateType[Any]
    handler: Handler | None  # None: the record has no type header; its decoded type decides


@dataclass(frozen=True, slots=True)
class OutcomeRoute:
    pass


Route = EventRoute | OutcomeRoute
_OUTCOME = OutcomeRoute()


@dataclass(frozen=True, slots=True)
class EventDelivery:
    handler: Handler
    event: Event
    record: EventRecord
    topic: str
    partition: int
    offset: int

    @property
    def source_id(self) -> str:
        return self.record.event_id

    @property
    def key(self) -> str:
        """What the ids of the commands a reactor sends for it derive from (`event_key`)."""
        return event_key(self.record.event_id, self.partition, self.offset)

    @property
    def correlation_id(self) -> str:
        return self.record.correlation_id

    def context_fields(self, subscription: str, replaying: bool) -> dict[str, Any]:
        r = self.record
        return {
            "subscription": subscription, "aggregate_type": r.aggregate_type, "aggregate_id": r.aggregate_id,
            "version": r.version, "event_id": r.event_id, "correlation_id": r.correlation_id,
            "causation_id": r.causation_id, "topic": self.topic, "partition": self.partition, "offset": self.offset,
            "replaying": replaying,
        }


@dataclass(frozen=True, slots=True)
class OutcomeDelivery:
    handler: Handler
    outcome: CommandOutcome
    topic: str
    partition: int
    offset: int

    @property
    def source_id(self) -> str:
        return self.outcome.command_id

    @property
    def key(self) -> str:
        return self.outcome.command_id

    @property
    def correlation_id(self) -> str:
        origin = self.outcome.origin
        return origin.event_id if origin is not None else self.outcome.command_id


Delivery = EventDelivery | OutcomeDelivery


async def call_handler(delivery: Delivery, subscription: str, replaying: bool, **extra: Any) -> Any:
    """Run the delivery's handler with the context its kind gets (`extra`: a database's `db`)."""
    if isinstance(delivery, OutcomeDelivery):
        context = OutcomeContext(subscription, delivery.topic, delivery.partition, delivery.offset, replaying)
        return await delivery.handler(delivery.outcome, context)
    fields = delivery.context_fields(subscription, replaying)
    if extra:
        return await delivery.handler(delivery.event, DatabaseContext(**fields, **extra))
    return await delivery.handler(delivery.event, Context(**fields))


class Router:
    def __init__(self, subscription: AnySubscription, registry: Mapping[str, AggregateType[Any]], app: str) -> None:
        self.subscription = subscription
        self.registry = registry
        names = TopicNames(app)
        self._events: dict[str, tuple[AggregateType[Any], dict[str, Handler]]] = {}
        self._known: dict[str, frozenset[str]] = {}  # each events topic's event types this code knows
        for aggregate in subscription.reads:
            handlers = {t.type_name(): h for t, h in subscription.handlers.items() if subscription.aggregate_of(t) is aggregate}
            self._events[names.events(aggregate.name)] = (aggregate, handlers)
            self._known[names.events(aggregate.name)] = frozenset(t.type_name() for t in aggregate.events)
        self.commands_topic = names.commands
        self.results_topic: str | None = None
        self._outcome_prefix = b'{"command_id":"' + f"{subscription.name}:".encode()
        if isinstance(subscription, Reactor) and subscription.outcome_handlers:
            self.results_topic = names.results

    @property
    def topics(self) -> list[str]:
        return [*self._events, *([self.results_topic] if self.results_topic else [])]

    def select(self, record: ConsumerRecord[bytes, bytes]) -> Route | None:
        """The handler's route for `record`, or None when the subscription does not read it;
        from the headers and key alone. An event of a type this code does not know (one the
        next release adds, written by a processor released first) is routed, for `decode`
        to tell: whether a handler of the next release takes it is not known here, and one
        passed over would be lost to it."""
        if record.topic == self.results_topic:
            value = record.value
            return _OUTCOME if value is not None and value.startswith(self._outcome_prefix) else None
        aggregate, handlers = self._events[record.topic]
        type_name = header(record, "esk-event-type")
        if type_name is None or type_name not in self._known[record.topic]:
            return EventRoute(aggregate, None)
        handler = handlers.get(type_name)
        return EventRoute(aggregate, handler) if handler is not None else None

    def decode(self, record: ConsumerRecord[bytes, bytes], route: Route) -> Delivery | None:
        """The record as its handler takes it (upcast to today's event schema); None when,
        decoded, it turns out not to be the subscription's. Raises Undecodable."""
        if isinstance(route, OutcomeRoute):
            return self._decode_outcome(record)
        try:
            event_record = EventRecord.decode(record.value)
        except DecodeError as error:
            raise Undecodable(f"DecodeError: {error}") from None
        handler = route.handler or self._events[record.topic][1].get(event_record.type)
        if handler is None:
            if event_record.type not in self._known[record.topic]:
                raise Undecodable(one_line(NewerSchemaVersion(
                    f"{route.aggregate.name} event {event_record.type} is of a type this code does not know: written by newer "
                    "code (run that code, or add the type here)"
                )))  # fmt: skip
            return None
        try:
            event = route.aggregate.decode_event(event_record.type, event_record.schema_version, event_record.data)
        except Exception as error:  # an unknown type, a payload the model refuses, an upcaster that raises
            raise Undecodable(one_line(error)) from None
        return EventDelivery(handler, event, event_record, record.topic, record.partition, record.offset)

    def outcome_of(self, record: ConsumerRecord[bytes, bytes]) -> str | None:
        """What an outcome's record is, in words (`outcome of <command>`), for where it is
        parked; None for an event's (its headers say)."""
        if record.topic != self.results_topic:
            return None
        try:
            return f"outcome of {Outcome.decode(record.value).command}"
        except (DecodeError, TypeError):  # what does not decode is parked as well
            return "outcome"

    def _decode_outcome(self, record: ConsumerRecord[bytes, bytes]) -> OutcomeDelivery | None:
        assert isinstance(self.subscription, Reactor)
        try:
            outcome = Outcome.decode(record.value)
        except DecodeError as error:
            raise Undecodable(f"DecodeError: {error}") from None
        aggregate = self.registry.get(outcome.aggregate_type)
        command_type = aggregate.commands.get(outcome.command) if aggregate is not None else None
        handler = self.subscription.outcome_handlers.get(command_type) if command_type is not None else None
        if handler is None:
            return None
        return OutcomeDelivery(handler, command_outcome(outcome, self.subscription.name), record.topic, record.partition, record.offset)


def command_outcome(outcome: Outcome, subscription: str) -> CommandOutcome:
    return CommandOutcome(
        outcome.command_id, outcome.aggregate_type, outcome.aggregate_id, outcome.command, outcome.status.value,
        outcome.version, outcome.code, outcome.detail, origin_of(subscription, outcome.command_id),
    )


def derived_command_id(subscription: str, key: str, n: int) -> str:
    """The id of the `n`th command a reactor sends for a delivery of `key` (its `key`)."""
    return f"{subscription}:{key}:{n}"


_PLACE = re.compile(r"@\d+\.\d+")


def origin_of(subscription: str, command_id: str) -> Origin | None:
    """The event a command id of `derived_command_id`'s making was derived from, through any
    number of outcomes. An event id is `<type>/<id>/<version>`, and a type name holds no
    `:`, so an event id never begins with `<subscription>:`; its place follows it
    (`event_key`), or not, in an id derived by esk before places were."""
    prefix = f"{subscription}:"
    rest, depth = command_id, 0
    while rest.startswith(prefix):
        rest, depth = rest[len(prefix):], depth + 1
    for _ in range(depth):
        rest, separator, n = rest.rpartition(":")
        if not separator or not n.isdigit():
            return None
    event_id, at, place = rest.rpartition("@")
    if at and _PLACE.fullmatch(at + place):
        rest = event_id
    aggregate_type, _, after_type = rest.partition("/")
    aggregate_id, _, version = after_type.rpartition("/")
    if depth == 0 or not aggregate_type or not aggregate_id or not version.isdigit():
        return None
    return Origin(rest, aggregate_type, aggregate_id, int(version))


async def reactor_commands(
    subscription: str, delivery: Delivery, replaying: bool, registry: Mapping[str, AggregateType[Any]] | None = None
) -> list[tuple[str, Send]]:
    """Run a reactor's handler; return its commands, each with its derived id. `registry`:
    the domain the processor runs, which each command's aggregate type must be in."""
    sends = await call_handler(delivery, subscription, replaying)
    # None too: a `return` forgotten on one path would drop its commands without a word.
    if not isinstance(sends, Sequence) or isinstance(sends, str):
        raise HandlerMistake(f"a reactor handler returns a list of Send (`[]` for none), not {'None' if sends is None else type(sends).__name__}")
    if strays := [s for s in sends if not isinstance(s, Send)]:  # a command not wrapped in Send, most often
        raise HandlerMistake(f"a reactor handler returns a list of Send (`[]` for none); it held {reprlib.repr(strays[0])}")
    for send in sends:
        aggregate_type = send.aggregate_type
        if type(send.command) not in aggregate_type.commands.values():
            raise HandlerMistake(
                f"it sends {type(send.command).__name__} to {aggregate_type.name}, whose commands are "
                f"{', '.join(f'{c.__name__} ({name})' for name, c in aggregate_type.commands.items())}"
            )
        # the processor would answer it unknown_aggregate_type, which no one reads
        if registry is not None and aggregate_type.name not in registry:
            raise HandlerMistake(f"it sends {type(send.command).__name__} to {aggregate_type.name}, which ESK_DOMAIN does not register")
    return [(derived_command_id(subscription, delivery.key, n), send) for n, send in enumerate(sends)]


def command_envelope(command_id: str, send: Send, delivery: Delivery) -> CommandEnvelope:
    return CommandEnvelope(
        command_id=command_id,
        aggregate_type=send.aggregate_type.name,
        aggregate_id=send.aggregate_id,
        command=send.command_name,
        payload=send.command.model_dump(mode="json"),
        expected_version=send.expected_version,
        correlation_id=delivery.correlation_id,
        causation_id=delivery.source_id,
    )


def check_outcome_commands(subscription: AnySubscription, registry: Mapping[str, AggregateType[Any]]) -> None:
    """A reactor's outcome handlers must be for commands of registered aggregate types."""
    if not isinstance(subscription, Reactor):
        return
    for command_type in subscription.outcome_handlers:
        if not any(command_type in a.commands.values() for a in registry.values()):
            raise ValueError(
                f"subscription {subscription.name!r} handles outcomes of {command_type.__name__}, "
                "a command of no registered aggregate type"
            )
