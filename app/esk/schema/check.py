"""`esk schema check`: the code against the lock file, as a list of findings.

Who reads each schema decides what breaks:
- an event's payloads are on its topic for good, so any change to an event's shape needs a
  new `schema_version` and upcasters that bring every locked older version to the current
  model; the upcasters are run on payloads generated from the locked schemas;
- a command's payloads come from HTTP clients written against the locked schema, so the new
  schema must accept all that the locked one did (a new optional field is fine);
- a state is rebuilt from the events when its model changes, so a change is information.

jsoncompat decides whether a changed command field still accepts every value it did;
Hypothesis draws the payloads the upcasters are run on (`esk.schema.examples`).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Literal

import jsoncompat
from hypothesis import HealthCheck, Verbosity, find, settings
from hypothesis.errors import HypothesisException, NoSuchExample
from pydantic import ValidationError

from ..domain.aggregate import AggregateType
from ..domain.json_schema import whole_digits
from ..registry import Registry
from .diff import Change, Schema, changes, differences, same_shape
from .examples import Unsupported, from_schema
from .lock import JsonSchema, Lock, LockedAggregate, LockedEvent, build_lock

# Payloads tried for each locked older version of an event. Derandomized: the same code and
# lock give the same verdict on every run, as a CI gate must.
EXAMPLES = 200
_LONGEST_EXAMPLE = 300


class Severity(StrEnum):
    BREAKING = "breaking"
    COMPATIBLE = "compatible"
    INFO = "info"


Subject = Literal["aggregate", "command", "event", "state"]


@dataclass(frozen=True)
class Finding:
    """One thing `esk schema check` reports."""

    severity: Severity
    aggregate: str
    subject: Subject
    name: str  # the command's or the event type's name; the aggregate type's for the others
    path: str  # the field, dotted (`lines[].qty`); "" for the whole
    message: str  # a sentence that names all of the above
    # The processor would write events of a shape that contradicts those stored under the
    # same schema version (changed without a new version, or a version gone back): beyond
    # any upcaster's mending, as both shapes would be read alike.
    contradicts_stored: bool = False

    def __str__(self) -> str:
        return self.message


def check(registry: Registry, lock: Lock, examples: int = EXAMPLES) -> list[Finding]:
    """Every difference between the code and `lock` that matters, breaking ones first."""
    current = build_lock(registry)
    findings: list[Finding] = []
    for name in sorted(lock.aggregates.keys() - registry.keys()):
        findings.append(Finding(
            Severity.BREAKING, name, "aggregate", name, "",
            f"{name}: aggregate type removed: its stored events could no longer be read, and its HTTP commands are gone",
        ))
    for name in sorted(registry.keys() - lock.aggregates.keys()):
        findings.append(Finding(Severity.COMPATIBLE, name, "aggregate", name, "", f"{name}: new aggregate type"))
    for name in sorted(registry.keys() & lock.aggregates.keys()):
        locked, now = lock.aggregates[name], current.aggregates[name]
        findings += _commands(name, locked, now)
        findings += _events(registry[name], locked, now, examples)
        findings += _state(name, locked, now)
    order = list(Severity)
    return sorted(findings, key=lambda f: order.index(f.severity))


# -- commands -------------------------------------------------------------------------


def _commands(aggregate: str, locked: LockedAggregate, now: LockedAggregate) -> Iterator[Finding]:
    for name in sorted(locked.commands.keys() | now.commands.keys()):
        subject = f"{aggregate} command {name}"
        if name not in now.commands:
            yield Finding(Severity.BREAKING, aggregate, "command", name, "", f"{subject}: removed: existing clients that send it get 404")
        elif name not in locked.commands:
            yield Finding(Severity.COMPATIBLE, aggregate, "command", name, "", f"{subject}: new command")
        else:
            yield from _command_changes(aggregate, name, locked.commands[name], now.commands[name])


def _command_changes(aggregate: str, name: str, before: JsonSchema, after: JsonSchema) -> Iterator[Finding]:
    subject = f"{aggregate} command {name}"
    breaking = False
    for change in differences(before, after):
        severity, consequence = _command_change(change, after)
        breaking |= severity is Severity.BREAKING
        yield Finding(severity, aggregate, "command", name, change.path, f"{subject}: {change.describe()}{consequence}")
    # Field by field is readable; the whole schema at once is the proof. A narrowing the walk
    # could not pin down (a change inside a model that became optional, say) is still found.
    if not breaking and not _accepts_all(before, after, before, after):
        yield Finding(
            Severity.BREAKING, aggregate, "command", name, "",
            f"{subject}: its schema no longer accepts every payload the locked one did: existing clients may be refused",
        )


def _command_change(change: Change, after: JsonSchema) -> tuple[Severity, str]:
    """How a change to a command reads for a client that sends what the locked schema allowed."""
    if change.kind == "added":
        if change.required:
            return Severity.BREAKING, ": existing clients do not send it"
        return Severity.COMPATIBLE, ""
    if change.kind == "removed":
        return Severity.BREAKING, ": existing clients that send it are refused"
    if change.kind == "now required":
        return Severity.BREAKING, ": existing clients may leave it out"
    if change.kind == "now optional":
        return Severity.COMPATIBLE, ""
    assert change.before is not None and change.after is not None
    # Judge this field's own keywords alone: its nested fields' changes are findings of their
    # own, so those come from `after` on both sides (and both read `after`'s definitions).
    own_change = {**{k: v for k, v in change.before.items() if k not in change.walked}, **{k: v for k, v in change.after.items() if k in change.walked}}
    if (bounds := change.decimal_bounds()) is not None:
        if _holds_all(*bounds):
            return Severity.COMPATIBLE, ", accepting every value it did"
        return Severity.BREAKING, ": existing clients may send values it refuses"
    unjudged = [k for k in _TEXT_CHECKS if change.after.get(k) is not None and change.after.get(k) != own_change.get(k)]
    if unjudged:
        return Severity.BREAKING, (
            f": existing clients may send texts its new {unjudged[0]} refuses (esk cannot tell whether it accepts "
            "every text the old one did)"
        )
    if _accepts_all(own_change, change.after, after, after):
        return Severity.COMPATIBLE, ", accepting every value it did"
    return Severity.BREAKING, ": existing clients may send values it refuses"


# A string's keywords jsoncompat passes over (it calls any pattern or format compatible): a
# new or changed one is judged here; dropping one only accepts more.
_TEXT_CHECKS = ("pattern", "format")


def _holds_all(before: tuple[int | None, int | None], after: tuple[int | None, int | None]) -> bool:
    """Whether a Decimal bounded by `after`'s (max_digits, decimal_places) holds every value
    one bounded by `before`'s did: as many digits, whole digits and places, or more."""

    def limits(max_digits: int | None, decimal_places: int | None) -> tuple[int | None, int | None, int | None]:
        places = max_digits if decimal_places is None else decimal_places
        return max_digits, whole_digits(max_digits, decimal_places), places

    return all(new is None or (old is not None and new >= old) for old, new in zip(limits(*before), limits(*after), strict=True))


def _accepts_all(before: Schema, after: Schema, root_before: Schema, root_after: Schema) -> bool:
    """Whether `after` accepts every value `before` does (jsoncompat's deserializer role: the
    new schema reads what was written against the old one). Unprovable is no."""
    documents = [{**schema, "$defs": root.get("$defs", {})} for schema, root in ((before, root_before), (after, root_after))]
    try:
        return jsoncompat.check_compat(json.dumps(documents[0]), json.dumps(documents[1]), jsoncompat.Role.DESERIALIZER)
    except ValueError:  # a keyword jsoncompat cannot reason about
        return False


# -- events ---------------------------------------------------------------------------


def _events(aggregate: AggregateType[Any], locked: LockedAggregate, now: LockedAggregate, examples: int) -> Iterator[Finding]:
    for name in sorted(locked.events.keys() | now.events.keys()):
        subject = f"{aggregate.name} event {name}"
        if name not in now.events:
            yield Finding(
                Severity.BREAKING, aggregate.name, "event", name, "",
                f"{subject}: event type removed: its events already stored could no longer be read",
            )
        elif name not in locked.events:
            yield Finding(Severity.COMPATIBLE, aggregate.name, "event", name, "", f"{subject}: new event type")
        else:
            yield from _event_changes(aggregate, name, locked.events[name], now.events[name], examples)


def _event_changes(aggregate: AggregateType[Any], name: str, locked: LockedEvent, now: LockedEvent, examples: int) -> Iterator[Finding]:
    subject = f"{aggregate.name} event {name}"
    version = locked.schema_version
    if now.schema_version < version:
        held = locked.older_versions.get(now.schema_version)
        if held is not None and same_shape(held, now.schema):
            # A rollback: the code writes an older version as it was, beside the newer ones
            # stored, which it does not read (their aggregates unusable, subscribers parking
            # them) until the newer code runs again. Two shapes under one version it is not.
            yield Finding(
                Severity.BREAKING, aggregate.name, "event", name, "",
                f"{subject}: schema_version went back from {version} to {now.schema_version}, its shape as locked before "
                f"(a rollback): v{version} events may be stored already, which this code does not read; keep this lock "
                f"for the release after it, which must not give v{version} another shape",
            )
            return
        yield Finding(
            Severity.BREAKING, aggregate.name, "event", name, "",
            f"{subject}: schema_version went back from {version} to {now.schema_version}: v{version} events may be stored already",
            contradicts_stored=True,
        )
        return
    if now.schema_version == version and not same_shape(locked.schema, now.schema):
        advice = f"but schema_version is still {version}: bump it to {version + 1} and add an upcaster from v{version}"
        for change in changes(locked.schema, now.schema):
            yield Finding(
                Severity.BREAKING, aggregate.name, "event", name, change.path, f"{subject}: {change.describe()}, {advice}", contradicts_stored=True
            )
    # Every locked version before the current one, the last locked one included: payloads of
    # each may be on the topic. The older ones passed before; they are checked again so that
    # a later edit to an upcaster cannot break them unnoticed.
    older = locked.before(now.schema_version)
    missing = [v for v in range(min(older, default=now.schema_version), now.schema_version) if (name, v) not in aggregate.upcasters]
    if missing:
        # A version never locked is not stored, but the older ones get through it, a step at a time.
        why = (f"stored v{missing[0]} events could no longer be read" if missing[0] in older
               else f"stored v{min(older)} events could not be brought to v{now.schema_version}, a version at a time")
        yield Finding(
            Severity.BREAKING, aggregate.name, "event", name, "",
            f"{subject}: no upcaster from v{missing[0]}, so {why}: add upcasters[({name!r}, {missing[0]})]",
        )
        return
    for old_version, schema in older.items():
        problem = _upcasting_problem(aggregate, name, old_version, schema, examples)
        if problem is not None:
            yield Finding(Severity.BREAKING, aggregate.name, "event", name, problem[0], f"{subject}: {problem[1]}")
        elif old_version == version:
            yield Finding(
                Severity.COMPATIBLE, aggregate.name, "event", name, "",
                f"{subject}: schema_version {version} -> {now.schema_version}; the upcasters bring generated v{version} payloads to valid v{now.schema_version} ones",
            )


def _upcasting_problem(aggregate: AggregateType[Any], name: str, version: int, schema: JsonSchema, examples: int) -> tuple[str, str] | None:
    """(field, what is wrong) when the upcasters do not bring payloads valid under the locked
    v`version` schema to ones the current event model accepts; None when they do."""
    model = aggregate.event_type(name)

    def refused(payload: dict[str, Any]) -> tuple[str, str] | None:
        """(field, why) the current model refuses `payload` once upcast; None when it does not."""
        try:
            model.model_validate(aggregate.upcast(name, version, copy.deepcopy(payload)))
        except ValidationError as error:
            first = error.errors()[0]
            field = ".".join(str(part) for part in first["loc"])
            return field, f"field `{field}`: {first['msg']}"
        except Exception as error:  # the upcaster is user code: whatever it raises is the finding
            return "", f"the upcaster raised {type(error).__name__}: {error}"
        return None

    budget = settings(
        max_examples=examples, derandomize=True, database=None, deadline=None,
        suppress_health_check=list(HealthCheck), verbosity=Verbosity.quiet,
    )  # fmt: skip
    try:
        # The smallest failing payload Hypothesis can shrink to: the easiest one to read.
        payload = find(from_schema(schema), lambda p: refused(p) is not None, settings=budget)
    except NoSuchExample:
        return None
    except (Unsupported, HypothesisException) as error:  # fail closed: upcasters nobody could check are not passed
        return "", f"the upcasters from v{version} could not be checked: esk cannot generate payloads of the locked v{version} schema ({error})"
    field, reason = refused(payload) or ("", "though not when tried again: the upcaster gives different answers")
    return field, f"the upcasters turn the v{version} payload {_json(payload)} into one the v{model.schema_version} model refuses ({reason})"


def _json(payload: Any) -> str:
    """`payload` as JSON to read in a line: every character that does not print (a C1
    control, a zero-width space, as Hypothesis draws them) escaped, as none would be seen."""
    text = json.dumps(payload, ensure_ascii=False, separators=(", ", ": "))
    text = "".join(c if c.isprintable() else json.dumps(c)[1:-1] for c in text)
    return text if len(text) <= _LONGEST_EXAMPLE else text[: _LONGEST_EXAMPLE - 3] + "..."


# -- state ----------------------------------------------------------------------------


def _state(aggregate: str, locked: LockedAggregate, now: LockedAggregate) -> Iterator[Finding]:
    changed = differences(locked.state, now.state)
    if changed or not same_shape(locked.state, now.state):
        fields = ", ".join(sorted({f"`{c.path}`" for c in changed if c.path}))
        yield Finding(
            Severity.INFO, aggregate, "state", aggregate, ", ".join(sorted({c.path for c in changed})),
            f"{aggregate} state changed: stored aggregates will be rebuilt from their events" + (f" ({fields})" if fields else ""),
        )
    if now.state_version != locked.state_version:
        yield Finding(
            Severity.INFO, aggregate, "state", aggregate, "state_version",
            f"{aggregate} state_version {locked.state_version} -> {now.state_version}: stored aggregates will be rebuilt from their events",
        )
