"""What an aggregate type is: pydantic commands, events and state plus two pure functions.

    decide(state, command) -> list[Event] | Rejection
    evolve(state, event)   -> state

`state` is None before the aggregate's first event. The lifecycle rules every aggregate
shares live here, not in each domain: a creating command on an existing aggregate is
rejected `already_exists`, any other command on a missing one `not_found`.

Nothing here knows about Kafka, HTTP or storage.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from types import MappingProxyType
from typing import Any, ClassVar, Generic, TypeVar

import orjson
from pydantic import BaseModel, ConfigDict, ValidationError

from .json_schema import model_schema


class Command(BaseModel):
    """A request to change one aggregate. Unknown fields are an error, not ignored."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class Event(BaseModel):
    """A fact. `schema_version` is bumped whenever the persisted shape changes; older
    payloads are brought up to date by the aggregate type's upcasters when read."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    schema_version: ClassVar[int] = 1

    @classmethod
    def type_name(cls) -> str:
        return cls.__name__


@dataclass(frozen=True)
class Rejection:
    """A command refused by the domain: a stable machine-readable code, a human detail."""

    code: str
    detail: str


NOT_FOUND = "not_found"
ALREADY_EXISTS = "already_exists"

S = TypeVar("S", bound=BaseModel)
Decision = Sequence[Event] | Rejection
# (event type name, schema version it reads) -> function returning the next version's payload
Upcasters = Mapping[tuple[str, int], Callable[[dict[str, Any]], dict[str, Any]]]


class UnknownEventType(LookupError):
    pass


class NewerSchemaVersion(ValueError):
    """A stored event of a schema version the code does not know yet: written by newer code."""


@dataclass(frozen=True)
class AggregateType(Generic[S]):
    """Registering an aggregate type is constructing one of these.

    `retention`, when given, says how long after its last event a *final* aggregate
    (one for which `is_final(state)` holds, e.g. a closed account) is kept before
    its state expires.

    `state_version` is raised when `evolve` changes what it makes of the same events (a
    fee rule, say) while the state model stays as it was: the stored states are rebuilt
    from the events, as they are when the model changes. No one can tell that from the code.
    """

    name: str
    state: type[S]
    commands: Mapping[str, type[Command]]
    events: Sequence[type[Event]]
    decide: Callable[[S | None, Any], Decision]
    evolve: Callable[[S | None, Any], S]
    creates: frozenset[type[Command]]
    upcasters: Upcasters = field(default_factory=dict)
    retention: timedelta | None = None
    is_final: Callable[[S], bool] = lambda _state: False
    state_version: int = 1
    # Derived from `events` once; frozen, so __post_init__ sets them through object.__setattr__.
    _events_by_name: Mapping[str, type[Event]] = field(init=False, repr=False, compare=False)
    _event_types: frozenset[type[Event]] = field(init=False, repr=False, compare=False)
    _state_shape: str = field(init=False, repr=False, compare=False)
    # What states are instances of, which `fold` checks at each event: a generic model's own
    # class (a `Box[int]`'s evolve may return a `Box`).
    _state_class: type[BaseModel] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.name.replace("_", "").replace("-", "").isalnum():
            raise ValueError(f"aggregate type name {self.name!r} must be alphanumeric (with - or _)")
        self._check_kinds()
        origin = self.state.__pydantic_generic_metadata__.get("origin")
        object.__setattr__(self, "_state_class", origin or self.state)
        unknown = self.creates - set(self.commands.values())
        if unknown:
            raise ValueError(f"creating commands not among the commands: {unknown}")
        object.__setattr__(self, "_events_by_name", {e.type_name(): e for e in self.events})
        object.__setattr__(self, "_event_types", frozenset(self.events))
        # A copy no one can change: the upcasters were checked as they are now.
        object.__setattr__(self, "upcasters", MappingProxyType(dict(self.upcasters)))
        for type_name, version in self.upcasters:
            self._check_upcaster(type_name, version)
        if self.state_version < 1:
            raise ValueError(f"{self.name}: state_version starts at 1, not {self.state_version}")
        schema = orjson.dumps(model_schema(self.state), option=orjson.OPT_SORT_KEYS)
        # The first version adds nothing: the shapes stored before there was one stay valid.
        state_version = b"" if self.state_version == 1 else f"/state v{self.state_version}".encode()
        object.__setattr__(self, "_state_shape", hashlib.sha256(schema + state_version).hexdigest()[:16])

    def _check_kinds(self) -> None:
        """What each argument is, told by the argument's name (a list for `commands`, a
        command among `events`, ... fail later in ways that name none of them)."""
        name = self.name
        if not (isinstance(self.state, type) and issubclass(self.state, BaseModel)):
            raise TypeError(f"{name}: state= is the state's model, a pydantic BaseModel class, not {self.state!r}")
        if not isinstance(self.commands, Mapping) or not all(
            isinstance(c, type) and issubclass(c, Command) for c in self.commands.values()
        ):
            raise TypeError(f"{name}: commands= maps each command's name in the URL to its Command class: {{'open': Open, ...}}")
        if not all(isinstance(c, type) and issubclass(c, Command) for c in self.creates):
            raise TypeError(f"{name}: creates= is a frozenset of the Command classes that make an aggregate")
        strays = [e for e in self.events if not (isinstance(e, type) and issubclass(e, Event))]
        if strays:
            raise TypeError(f"{name}: events= holds what is not an Event class: {', '.join(map(repr, strays))}")
        names = [e.type_name() for e in self.events]
        if len(set(names)) < len(names):
            raise ValueError(f"{name}: events= names an event type twice: {sorted({n for n in names if names.count(n) > 1})}")
        for function in ("decide", "evolve"):
            if not callable(getattr(self, function)):
                raise TypeError(f"{name}: {function}= is a function, not {getattr(self, function)!r}")

    def _check_upcaster(self, type_name: str, version: int) -> None:
        """An upcaster no stored event could ever reach is a mistake (a key one version too
        high, a renamed event), not something to find when an old event fails to read."""
        model = self._events_by_name.get(type_name)
        if model is None:
            raise ValueError(f"{self.name}: an upcaster for {type_name!r}, which is none of its events")
        if not 1 <= version < model.schema_version:
            keys = f"1 to {model.schema_version - 1}" if model.schema_version > 1 else "none for a v1 event"
            raise ValueError(
                f"{self.name}: the upcaster ({type_name!r}, {version}) would take v{version} to v{version + 1}, but {type_name} "
                f"is v{model.schema_version}: an upcaster is keyed by the version it reads ({keys})"
            )

    # -- commands --------------------------------------------------------------

    def parse_command(self, name: str, payload: Any) -> Command:
        """Validate a payload; raises KeyError for an unknown command, pydantic's
        ValidationError for a bad payload."""
        return self.commands[name].model_validate(payload)

    def handle(self, state: S | None, command: Command, aggregate_id: str | None = None) -> Decision:
        """The lifecycle rules, then the domain's own decision; `aggregate_id` names the
        aggregate in the lifecycle's rejections."""
        creating = type(command) in self.creates
        which = self.name if aggregate_id is None else f"{self.name} {aggregate_id!r}"
        if state is None and not creating:
            return Rejection(NOT_FOUND, f"{which} does not exist")
        if state is not None and creating:
            return Rejection(ALREADY_EXISTS, f"{which} already exists")
        decided: object = self.decide(state, command)  # the user's code: whatever it returned
        if isinstance(decided, Rejection):
            return decided
        if not isinstance(decided, Sequence | Iterator) or isinstance(decided, str | bytes | BaseModel):
            raise TypeError(
                f"{self.name}.decide returned {type(decided).__name__} for {type(command).__name__}: "
                "it returns a list of events, or a Rejection"
            )
        events: list[Event] = []
        for event in decided:
            if not isinstance(event, Event):
                raise TypeError(f"{self.name}.decide returned a list holding {type(event).__name__}: a list of events, or a Rejection")
            if type(event) not in self._event_types:
                raise TypeError(f"{self.name}.decide returned an unregistered event {type(event).__name__}")
            events.append(event)
        return events

    def fold(self, events: Iterable[Event], state: S | None = None) -> S | None:
        for event in events:
            state = self.evolve(state, event)
            # Not caught here, a forgotten `return` would store the events with no state, so
            # that the next command wrote the same version again.
            if not isinstance(state, self._state_class):
                raise TypeError(
                    f"{self.name}.evolve returned {type(state).__name__} for {type(event).__name__}: "
                    f"it returns the state, a {self.state.__name__}"
                )
        return state

    # -- events ----------------------------------------------------------------

    def event_type(self, type_name: str) -> type[Event]:
        try:
            return self._events_by_name[type_name]
        except KeyError:
            raise UnknownEventType(f"{self.name} has no event type {type_name!r}") from None

    def upcast(self, type_name: str, schema_version: int, data: dict[str, Any]) -> dict[str, Any]:
        """Bring a stored payload from `schema_version` up to the event class's current one."""
        current = self.event_type(type_name).schema_version
        while schema_version < current:
            step = self.upcasters.get((type_name, schema_version))
            if step is None:
                raise ValueError(f"no upcaster for {self.name}.{type_name} v{schema_version}")
            data = step(data)
            schema_version += 1
        return data

    def known_event_type(self, type_name: str, schema_version: int) -> type[Event]:
        """The event class a stored event of `schema_version` is read as. Raises
        UnknownEventType, and NewerSchemaVersion for a version the code does not know yet:
        read as the older version it is not, its data would mean something else."""
        model = self.event_type(type_name)
        if schema_version > model.schema_version:
            raise NewerSchemaVersion(
                f"{self.name} event {type_name} v{schema_version} is newer than this code's v{model.schema_version}: "
                "written by newer code (run that code, or add the version here)"
            )
        return model

    def decode_event(self, type_name: str, schema_version: int, data: dict[str, Any]) -> Event:
        return self.known_event_type(type_name, schema_version).model_validate(self.upcast(type_name, schema_version, data))

    def current_payload(self, type_name: str, schema_version: int, data: dict[str, Any]) -> dict[str, Any]:
        """A stored payload as the current event class writes it: upcast, validated (its
        defaults filled in, its values coerced) and dumped as the processor dumps events,
        so that a read model or a history shows an old event as the processor and the
        subscribers read it (decode_event), not as its upcasters alone leave it."""
        return self.decode_event(type_name, schema_version, data).model_dump(mode="json")

    # -- state -----------------------------------------------------------------

    @property
    def state_shape(self) -> str:
        """A fingerprint of the state model's JSON schema and `state_version`. Each stored
        state records the shape that wrote it; a stored state of another shape is rebuilt
        from the events."""
        return self._state_shape

    def expires_at(self, state: S, last_event_ms: int) -> int | None:
        """When a final aggregate's state expires, in epoch milliseconds (None: it is kept).
        Milliseconds, as stored: this runs for every command that changes an aggregate."""
        if self.retention is None or not self.is_final(state):
            return None
        return last_event_ms + self.retention // timedelta(milliseconds=1)


def one_line(error: Exception) -> str:
    """`error` in one line, as an event's decoding tells it (a log line, a parked event's
    reason): a ValidationError by its fields (pydantic's own text runs over several lines,
    with a link per error)."""
    if isinstance(error, ValidationError):
        return "; ".join(f"{'.'.join(map(str, e['loc'])) or 'the whole'}: {e['msg']}" for e in error.errors())
    return f"{type(error).__name__}: {' '.join(str(error).split())}"
