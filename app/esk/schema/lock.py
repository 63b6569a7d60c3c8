"""The lock file: the JSON Schema of every command, event and state of the registered
aggregate types, as `esk schema lock` last wrote it and the user committed it.

An event keeps the schemas of its earlier versions that an earlier lock saw
(`older_versions`): payloads of every one of them may be on its topic, so
`esk schema check` runs the upcasters on each. Keys are sorted and the JSON indented, so
that a change to a model is a readable diff of the lock in review.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
from pydantic import BaseModel
from pydantic.errors import PydanticUserError

from ..domain.aggregate import AggregateType
from ..domain.json_schema import model_schema
from ..registry import Registry

LOCK_FILE = Path("esk.lock.json")
FORMAT = 1

JsonSchema = dict[str, Any]


class LockError(Exception):
    """The lock file is missing or unreadable, or a model has no JSON Schema; the message says
    what to do."""


class LockedEvent(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    schema_version: int
    schema: JsonSchema
    older_versions: dict[int, JsonSchema] = {}

    def before(self, version: int) -> dict[int, JsonSchema]:
        """The schemas this lock holds of the event's versions before `version`, oldest
        first: its older ones, and its own when `version` is past it (code that raised the
        version since)."""
        held = {**self.older_versions, self.schema_version: self.schema}
        return {v: held[v] for v in sorted(held) if v < version}


class LockedAggregate(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    commands: dict[str, JsonSchema]
    events: dict[str, LockedEvent]
    state: JsonSchema
    # Written once raised: a lock of an aggregate type that never raised it reads the same
    # as those of esk releases before it was locked.
    state_version: int = 1


class Lock(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    format: int
    aggregates: dict[str, LockedAggregate]


def build_lock(registry: Registry, previous: Lock | None = None) -> Lock:
    """The lock of the code as it is; the schemas of events' earlier versions are carried
    over from `previous`."""
    return Lock(
        format=FORMAT,
        aggregates={
            name: _lock_aggregate(aggregate, previous.aggregates.get(name) if previous else None)
            for name, aggregate in registry.items()
        },
    )


def project_lock() -> Lock | None:
    """The project's lock file (LOCK_FILE, in the directory esk runs in); None when it has
    none. Raises LockError when it cannot be read."""
    return read_lock() if LOCK_FILE.exists() else None


def read_lock(path: Path = LOCK_FILE) -> Lock:
    try:
        text = path.read_bytes()
    except FileNotFoundError:
        raise LockError(f"no lock file {path}: run `esk schema lock` to write it, and commit it") from None
    except OSError as error:
        raise LockError(f"cannot read {path}: {error.strerror}") from None
    try:
        lock = msgspec.json.decode(text, type=Lock)
    except msgspec.DecodeError as error:  # ValidationError is one too
        raise LockError(f"{path} is not an esk lock file ({error}): restore it from version control, or delete it and run `esk schema lock`") from None
    if lock.format != FORMAT:
        raise LockError(f"{path} has lock format {lock.format}, this esk reads {FORMAT}: use the esk that wrote it, or delete it and run `esk schema lock`")
    return lock


def write_lock(lock: Lock, path: Path = LOCK_FILE) -> None:
    path.write_text(dumps(lock), encoding="utf-8")


def dumps(lock: Lock) -> str:
    return json.dumps(msgspec.to_builtins(lock), indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def json_schema(model: type[BaseModel]) -> JsonSchema:
    """The model's JSON Schema in validation mode: what the model accepts, as /openapi.json
    documents it. For an event, that is what reading a stored payload demands of it."""
    try:
        return model_schema(model)
    except PydanticUserError as error:  # a field type JSON Schema cannot express
        raise LockError(f"{model.__module__}.{model.__qualname__} has no JSON Schema: {error}") from None


def _lock_aggregate(aggregate: AggregateType[Any], previous: LockedAggregate | None) -> LockedAggregate:
    events = {}
    for event in aggregate.events:
        name, version = event.type_name(), event.schema_version
        locked = previous.events.get(name) if previous else None
        # The versions before this one that earlier locks saw, the last locked one included.
        older = locked.before(version) if locked else {}
        events[name] = LockedEvent(schema_version=version, schema=json_schema(event), older_versions=older)
    return LockedAggregate(
        commands={name: json_schema(command) for name, command in aggregate.commands.items()},
        events=events,
        state=json_schema(aggregate.state),
        state_version=aggregate.state_version,
    )
