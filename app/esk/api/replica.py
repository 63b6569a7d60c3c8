"""Every API instance keeps a local replica of all state stores, fed by the changelog.

It answers GET requests, waits for command outcomes (the `c/<command_id>` records) and
gives read-your-writes from ANY instance: the changelog records of a command commit in
the same transaction as its events, so once one instance saw an outcome, every instance
will see the version it reports.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

from aiokafka import TopicPartition

from ..kafka.metadata import topic_partitions
from ..kafka.topics import TopicNames
from ..protocol import Outcome, StoredAggregate, aggregate_key, command_key
from ..settings import Settings
from ..state.resources import StoreResources
from ..state.restore import changelog_updates
from ..state.store import RocksDBStore
from .follower import Batches, Offsets, TopicFollower


class StateReplica(TopicFollower):
    def __init__(self, settings: Settings, memory_budget_mb: int = 128) -> None:
        path = Path(settings.api.state_dir) / f"{settings.app}.replica"
        super().__init__(settings, path, StoreResources(memory_budget_mb), "replica", "api")
        self.topic = TopicNames(settings.app).changelog

    async def partitions(self) -> list[TopicPartition]:
        return [TopicPartition(self.topic, p) for p in await topic_partitions(self.settings, self.topic)]

    def stored_offsets(self, store: RocksDBStore) -> Offsets:
        return {TopicPartition(self.topic, p): offset for p, offset in store.changelog_offsets().items()}

    def write(self, store: RocksDBStore, batches: Batches, offsets: Offsets) -> Iterable[bytes]:
        # The same layout as a processor's store: data, and the offsets in its meta column family.
        updates = changelog_updates(batches)
        store.write(updates, {tp.partition: offset for tp, offset in offsets.items()})
        return updates

    # -- reads -------------------------------------------------------------------

    def aggregate(self, aggregate_type: str, aggregate_id: str) -> StoredAggregate | None:
        raw = self.store.get(aggregate_key(aggregate_type, aggregate_id)) if self.store else None
        return StoredAggregate.decode(raw) if raw is not None else None

    def outcome(self, command_id: str) -> Outcome | None:
        raw = self.store.get(command_key(command_id)) if self.store else None
        return Outcome.decode(raw) if raw is not None else None

    async def wait_outcome(self, command_id: str, wanted: Callable[[Outcome], bool], timeout_s: float) -> Outcome | None:
        """The command's outcome once there is one that is `wanted`, or None after `timeout_s`."""

        def found() -> Outcome | None:
            outcome = self.outcome(command_id)
            return outcome if outcome is not None and wanted(outcome) else None

        return await self._wait(command_key(command_id), found, timeout_s)

    async def wait_version(
        self, aggregate_type: str, aggregate_id: str, min_version: int, timeout_s: float
    ) -> StoredAggregate | None:
        def current() -> StoredAggregate | None:
            found = self.aggregate(aggregate_type, aggregate_id)
            return found if found is not None and found.version >= min_version else None

        await self._wait(aggregate_key(aggregate_type, aggregate_id), current, timeout_s)
        return self.aggregate(aggregate_type, aggregate_id)
