"""Every API instance keeps a local index of every event of every aggregate type, fed by the
events topics: `GET /v1/{type}/{id}/events` reads an aggregate's history from it.

The events topics keep everything (retention.ms=-1), so an index built from their
beginning holds the whole history; it is read_committed, so an aborted event never shows.
A read given a command's position (`after`) waits until the index has read past it: the
command's events commit in its transaction, below that position.

Keys sort an aggregate's events by version (`protocol.history_key`); values are the event
records as on their topic, upcast when read, so a new upcaster applies to what was indexed
before it. The positions the index reflects are ordinary keys of the same store
(`o/<topic>/<partition>`), written in the same write as the events they cover.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiokafka import TopicPartition

from ..domain.aggregate import AggregateType, UnknownEventType
from ..kafka.metadata import topic_partitions
from ..kafka.topics import TopicNames
from ..metrics import HISTORY_POSITION
from ..projections.positions import Positions
from ..protocol import DecodeError, EventRecord, history_key, history_prefix, position, prefix_end
from ..registry import Registry
from ..settings import Settings
from ..state.resources import StoreResources
from ..state.store import RocksDBStore, StateStore
from .follower import Batches, Offsets, TopicFollower

log = logging.getLogger(__name__)

OFFSET_PREFIX = b"o/"


def offset_key(tp: TopicPartition) -> bytes:
    # Topic names hold no "/" (Kafka allows letters, digits, ".", "_" and "-").
    return OFFSET_PREFIX + f"{tp.topic}/{tp.partition}".encode()


def history_updates(store: StateStore, batches: Batches, offsets: Offsets) -> dict[bytes, bytes | None]:
    """What a fetch of events amounts to in the index, offsets included.

    An aggregate that expired and was created anew starts again at version 1, and its
    events topic then holds a second history for the same id: like its state, its history
    is the new one's, so a version 1 drops whatever the index holds of the earlier one.
    Whether there is an earlier one is a point lookup of its version 1 (one call for the
    fetch); only then is its range scanned, which costs far more, once per new aggregate."""
    decoded: list[tuple[bytes, bytes, EventRecord]] = []
    for tp, records in batches.items():
        for record in records:
            try:
                event = EventRecord.decode(record.value)
                key = history_key(event.aggregate_type, event.aggregate_id, event.version)
            except (DecodeError, OverflowError) as error:  # not written by esk: nothing to show
                log.warning("history index: %s left out (%s)", position(tp.topic, tp.partition, record.offset), error)
                continue
            decoded.append((key, record.value, event))
    earlier = store.get_many([key for key, _, event in decoded if event.version == 1])
    updates: dict[bytes, bytes | None] = {}
    fetched: dict[bytes, list[bytes]] = {}  # aggregate's prefix -> its keys in this fetch
    for key, value, event in decoded:
        prefix = history_prefix(event.aggregate_type, event.aggregate_id)
        if event.version == 1:
            for dropped in fetched.pop(prefix, ()):
                updates[dropped] = None
            if earlier.get(key) is not None:
                for dropped, _ in store.scan(prefix, prefix_end(prefix)):
                    updates[dropped] = None
        updates[key] = value
        fetched.setdefault(prefix, []).append(key)
    for tp, offset in offsets.items():
        updates[offset_key(tp)] = struct.pack(">q", offset)
    return updates


@dataclass(frozen=True)
class HistoryPage:
    events: list[dict[str, Any]]
    next_version: int | None  # where the next page starts; None: this one ends the history


def as_current(
    aggregate: AggregateType[Any] | None, type_name: str, schema_version: int, data: dict[str, Any], where: str
) -> tuple[dict[str, Any], int]:
    """A stored event's payload and schema version as the HTTP API shows them: in its event
    type's current schema where the domain's upcasters can bring it there (as the OpenAPI
    document describes it), else as stored, told in a WARNING naming `where`."""
    if aggregate is None:
        return data, schema_version
    try:
        current = aggregate.event_type(type_name).schema_version
        if schema_version < current:
            return aggregate.current_payload(type_name, schema_version, data), current
    except UnknownEventType:  # newer code's (a processor released first): as it wrote it, nothing amiss
        pass
    except Exception as error:  # the domain's code: the event is still shown, as stored
        log.warning("%s: %s v%d shown as stored (%r)", where, type_name, schema_version, error)
    return data, schema_version


def events_as_current(aggregate: AggregateType[Any] | None, events: list[dict[str, Any]], where: str) -> list[dict[str, Any]]:
    """A command's events (Outcome.events) as the HTTP API shows them (`as_current`)."""
    shown = []
    for event in events:
        data, schema_version = as_current(aggregate, event["type"], event["schema_version"], event["data"], where)
        shown.append(event if data is event["data"] else {**event, "data": data, "schema_version": schema_version})
    return shown


class EventHistory(TopicFollower):
    def __init__(self, settings: Settings, registry: Registry) -> None:
        path = Path(settings.api.state_dir) / f"{settings.app}.history"
        super().__init__(settings, path, StoreResources(settings.api.history_memory_budget_mb), "history", "api-history")
        self.registry = registry
        names = TopicNames(settings.app)
        self.topics = frozenset(names.events(name) for name in registry)

    async def partitions(self) -> list[TopicPartition]:
        return [TopicPartition(topic, p) for topic in sorted(self.topics) for p in await topic_partitions(self.settings, topic)]

    def stored_offsets(self, store: RocksDBStore) -> Offsets:
        offsets: Offsets = {}
        for key, value in store.scan(OFFSET_PREFIX, prefix_end(OFFSET_PREFIX)):
            topic, _, partition = key[len(OFFSET_PREFIX):].decode().rpartition("/")
            offsets[TopicPartition(topic, int(partition))] = struct.unpack(">q", value)[0]
        return offsets

    def write(self, store: RocksDBStore, batches: Batches, offsets: Offsets) -> Iterable[bytes]:
        store.write(history_updates(store, batches, offsets), {})
        return ()  # nobody waits on a key of the index: reads wait on its positions (moved)

    def written(self, offsets: Offsets) -> None:
        for tp, offset in offsets.items():
            HISTORY_POSITION.labels(tp.topic, str(tp.partition)).set(offset)

    # -- reads -------------------------------------------------------------------

    def positions(self) -> Positions:
        return {(tp.topic, tp.partition): offset for tp, offset in self.offsets().items()}

    async def current_positions(self) -> Positions:
        return self.positions()

    def events(
        self, aggregate_type: str, aggregate_id: str, from_version: int = 1, limit: int | None = None
    ) -> HistoryPage:
        """The aggregate's events in version order from `from_version`, `limit` of them at
        most, as the HTTP API shows them: `data` in its event type's current schema where
        the domain's upcasters can bring it there."""
        store = self.store
        if store is None:
            return HistoryPage([], None)
        prefix = history_prefix(aggregate_type, aggregate_id)
        aggregate = self.registry.get(aggregate_type)
        events: list[dict[str, Any]] = []
        for key, value in store.scan(history_key(aggregate_type, aggregate_id, from_version), prefix_end(prefix)):
            if len(key) != len(prefix) + 8:
                continue  # an id with "/" that no command could have (a foreign writer's)
            if limit is not None and len(events) == limit:
                return HistoryPage(events, int.from_bytes(key[len(prefix):], "big"))
            event = EventRecord.decode(value)
            data, schema_version = as_current(aggregate, event.type, event.schema_version, event.data, f"history of {aggregate_type} {aggregate_id!r}")
            events.append({
                "event_id": event.event_id,
                "type": event.type,
                "version": event.version,
                "schema_version": schema_version,
                "recorded_at": event.recorded_at,
                "command_id": event.command_id,
                "data": data,
            })
        return HistoryPage(events, None)

    async def read(self, aggregate_type: str, aggregate_id: str, from_version: int, limit: int) -> HistoryPage:
        # Off the event loop: a long history decodes (and upcasts) for a while, and the loop
        # takes every command the API serves.
        return await asyncio.to_thread(self.events, aggregate_type, aggregate_id, from_version, limit)
