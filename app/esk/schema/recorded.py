"""The schemas of the event versions stored, recorded on `<app>.schemas` by the processors
that write them: what a processor's start holds its code to.

The lock file (esk.schema.lock) holds the code to the schemas it was locked with, but it
lives with the code: a rollback reverts it with the code, and a release built from there
(a hotfix) may give a version the next release used already another shape, which the lock
it carries never saw. Stored events of the two shapes could never be told apart again. The
brokers keep what was written: before it writes an event, a processor records the schema
of each event version its code writes (one compacted record each, `<type>/<event>/<version>`),
and refuses to start on code that writes a version recorded with another shape."""

from __future__ import annotations

import json
import logging

from aiokafka import AIOKafkaProducer

from ..kafka.client_options import client_options
from ..kafka.reader import read_committed
from ..kafka.topics import TopicNames
from ..registry import Registry
from ..settings import Settings
from .diff import changes, same_shape
from .lock import JsonSchema, build_lock

log = logging.getLogger(__name__)


class SchemasContradicted(Exception):
    """The code writes an event version the brokers hold events of another shape of."""

    def __init__(self, told: list[str], topic: str) -> None:
        super().__init__(
            f"{topic}: this code would write events of another shape under schema versions stored already (above), "
            "and the two could never be told apart again: give the changed events a new schema version (past every one "
            "recorded) and an upcaster"
        )
        self.told = told


def schema_key(aggregate_type: str, event: str, schema_version: int) -> str:
    return f"{aggregate_type}/{event}/{schema_version}"


def written_schemas(registry: Registry) -> dict[str, JsonSchema]:
    """The schema of each event version the code writes (its events' current versions)."""
    lock = build_lock(registry)
    return {
        schema_key(name, event, locked.schema_version): locked.schema
        for name, aggregate in lock.aggregates.items()
        for event, locked in aggregate.events.items()
    }


async def recorded_schemas(settings: Settings) -> dict[str, JsonSchema]:
    """What `<app>.schemas` holds: the schema of each event version written so far."""
    recorded: dict[str, JsonSchema] = {}
    for record in await read_committed(settings, TopicNames(settings.app).schemas):
        if record.key is None:
            continue
        if record.value is None:  # an operator's tombstone: the record is forgotten
            recorded.pop(record.key.decode(), None)
        else:
            recorded[record.key.decode()] = json.loads(record.value)
    return recorded


def contradictions(written: dict[str, JsonSchema], recorded: dict[str, JsonSchema], topic: str) -> list[str]:
    """Each event version the code writes that `recorded` holds with another shape, told
    field by field."""
    told = []
    for key, schema in written.items():
        held = recorded.get(key)
        if held is None or same_shape(held, schema):
            continue
        aggregate_type, event, version = key.rsplit("/", 2)
        for change in changes(held, schema):
            told.append(
                f"{aggregate_type} event {event} v{version}: {change.describe()}, against the v{version} events stored "
                f"(their schema is recorded on {topic} by the processor that wrote them)"
            )
    return told


async def hold_to_recorded_schemas(settings: Settings, registry: Registry, refuse: bool) -> None:
    """Checks the code against `<app>.schemas`, then records what it writes that is not
    there yet: before the processor writes an event of it. Raises SchemasContradicted when
    `refuse` (a production processor); else (esk dev's: a developer's data) tells each
    contradiction in a WARNING and leaves its record as it is."""
    topic = TopicNames(settings.app).schemas
    written = written_schemas(registry)
    recorded = await recorded_schemas(settings)
    told = contradictions(written, recorded, topic)
    if told and refuse:
        raise SchemasContradicted(told, topic)
    for line in told:
        log.warning("%s", line)
    missing = {key: schema for key, schema in written.items() if key not in recorded}
    if not missing:
        return
    producer = AIOKafkaProducer(**client_options(settings), acks="all", enable_idempotence=True)
    await producer.start()
    try:
        for key, schema in missing.items():
            await producer.send_and_wait(topic, json.dumps(schema, sort_keys=True).encode(), key=key.encode())
    finally:
        await producer.stop()
    log.info("recorded on %s: %s", topic, ", ".join(sorted(missing)))
