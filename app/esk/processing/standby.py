"""StandbyTasks: warm copies of partitions this process does not own.

Each standby store follows its changelog partition read_committed, exactly as a restore
would, and records the offset it reached (past transaction markers, as a restore does) in
the same write batch as the data. When the partition moves here, the active task opens
the same store and its restore replays only the tail. A standby never writes to Kafka,
and it only ever sees committed records, so it is never ahead of what the owner committed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from pathlib import Path

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.structs import ConsumerRecord

from ..kafka.reader import committed_reader
from ..kafka.stopping import stop_consumer
from ..metrics import RESTORE_RECORDS, STANDBY_TASKS
from ..settings import Settings
from ..state.resources import StoreResources
from ..state.restore import changelog_updates
from ..state.store import RocksDBStore, open_store

log = logging.getLogger(__name__)


class StandbyTasks:
    def __init__(
        self, settings: Settings, changelog: str, resources: StoreResources, store_path: Callable[[int], Path]
    ) -> None:
        self.settings = settings
        self.changelog = changelog
        self.resources = resources
        self.store_path = store_path
        self._stores: dict[int, RocksDBStore] = {}
        self._positions: dict[int, int] = {}  # partition -> the offset its store last recorded
        # Held while the reader fetches and applies, and while the set of partitions changes.
        self._lock = asyncio.Lock()
        self._reader: AIOKafkaConsumer | None = None

    @property
    def partitions(self) -> set[int]:
        return set(self._stores)

    def offsets(self) -> dict[int, int]:
        """partition -> next changelog offset each warm copy will apply."""
        return {p: store.changelog_offsets().get(p, 0) for p, store in self._stores.items()}

    async def assign(self, partitions: set[int]) -> None:
        """Keep exactly these partitions warm; a store given up is closed (its files stay)."""
        async with self._lock:
            before = set(self._stores)
            for partition in set(self._stores) - partitions:
                self._stores.pop(partition).close()
                self._positions.pop(partition, None)
            for partition in sorted(partitions - set(self._stores)):
                self._stores[partition] = await open_store(self.store_path(partition), self.resources)
            STANDBY_TASKS.set(len(self._stores))
            if self._reader is None:
                return
            tps = [TopicPartition(self.changelog, p) for p in sorted(self._stores)]
            self._reader.assign(tps)
            if tps:
                beginnings = await self._reader.beginning_offsets(tps)
                for tp in tps:
                    stored = self._stores[tp.partition].changelog_offsets().get(tp.partition)
                    self._reader.seek(tp, max(stored if stored is not None else 0, beginnings[tp]))
        if partitions:
            log.info("standby for partitions %s", sorted(partitions))
        elif before:  # the last line said which it kept
            log.info("standby for no partition now")

    async def _apply(
        self, reader: AIOKafkaConsumer, batches: Mapping[TopicPartition, list[ConsumerRecord[bytes, bytes]]]
    ) -> None:
        """Write what was fetched, with the reader's position, as a restore does. The
        position moves past transaction markers too, and a marker may come in a fetch of
        its own, without records: a copy that stopped before its partition's last marker
        would never equal a restore's end, and its owner would replay that marker."""
        for partition, store in self._stores.items():
            tp = TopicPartition(self.changelog, partition)
            records = batches.get(tp, [])
            position = await reader.position(tp)
            if not records and position == self._positions.get(partition):
                continue
            store.write(changelog_updates({tp: records}, expiry_index=True), {partition: position})
            self._positions[partition] = position
            RESTORE_RECORDS.labels("standby").inc(len(records))

    async def run(self, stop: asyncio.Event) -> None:
        reader = committed_reader(self.settings, f"{self.changelog}-standby")
        await reader.start()
        try:
            async with self._lock:
                self._reader = reader
            await self.assign(self.partitions)  # position the reader on what was assigned so far
            while not stop.is_set():
                if not self._stores:
                    await asyncio.sleep(0.2)
                    continue
                async with self._lock:
                    batches = await reader.getmany(timeout_ms=100, max_records=10_000)
                    await self._apply(reader, batches)
        finally:
            async with self._lock:
                self._reader = None
                for store in self._stores.values():
                    store.close()
                self._stores.clear()
                self._positions.clear()
                STANDBY_TASKS.set(0)
            await stop_consumer(reader)
