"""EventPositions: where an accepted command's events are, for its answer (read-your-writes).

The position is the end of the aggregate's events partition as written (its high watermark,
not its last stable offset), looked up once the outcome is in. The command's events were
written before its transaction committed, so they lie below that end; but Kafka writes a
transaction's commit markers partition by partition, so the outcome can be read while the
events partition's marker is still to come, and its last stable offset then stands at or
before the command's events. A reader given the position waits until it has read that
partition up to it, which it can only do once every transaction below it is decided.
Answers waiting at the same moment share one ListOffsets request, so the cost is one round
trip to the broker per answer at most, not a request each.
"""

from __future__ import annotations

import asyncio
import logging

from aiokafka import AIOKafkaConsumer, TopicPartition

from ..kafka.metadata import topic_partitions
from ..kafka.partitioner import partition_for
from ..kafka.reader import lone_reader
from ..kafka.stopping import stop_consumer
from ..kafka.topics import TopicNames
from ..projections.positions import Position
from ..protocol import Outcome
from ..settings import Settings

log = logging.getLogger(__name__)


class EventPositions:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.topics = TopicNames(settings.app)
        self.timeout_s = settings.api.position_timeout_s
        self._consumer: AIOKafkaConsumer | None = None
        self._waiting: dict[TopicPartition, list[asyncio.Future[int]]] = {}
        self._lookup: asyncio.Task[None] | None = None
        self._partitions: dict[str, int] = {}  # of each events topic

    async def start(self) -> None:
        # read_uncommitted: its end offsets are the partitions' high watermarks
        self._consumer = lone_reader(self.settings, "read_uncommitted", f"{self.settings.app}.api.positions")
        await self._consumer.start()

    async def stop(self) -> None:
        if self._lookup is not None:
            self._lookup.cancel()
        if self._consumer is not None:
            await stop_consumer(self._consumer)

    async def of(self, outcome: Outcome) -> Position | None:
        """The position below which `outcome`'s events lie; None when it cannot be told in
        time (a broker away): the answer goes out without it rather than late."""
        if not outcome.events or self.timeout_s <= 0:  # 0: answers without positions
            return None
        try:
            return await asyncio.wait_for(self._position(outcome), self.timeout_s)
        except Exception as error:  # the command is done: its answer must not fail for this
            log.debug("no position for %s: %r", outcome.command_id, error)
            return None

    async def _position(self, outcome: Outcome) -> Position:
        assert self._consumer is not None, "EventPositions.start() was not awaited"
        topic = self.topics.events(outcome.aggregate_type)
        tp = TopicPartition(topic, partition_for(outcome.aggregate_id.encode(), await self.partitions(topic)))
        waiter: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(tp, []).append(waiter)
        if self._lookup is None or self._lookup.done():
            self._lookup = asyncio.create_task(self._look_up())
        return Position(tp.topic, tp.partition, await waiter)

    async def partitions(self, topic: str) -> int:
        """How many partitions an events topic has (asked once: esk never adds any)."""
        if topic not in self._partitions:
            self._partitions[topic] = len(await topic_partitions(self.settings, topic))
        return self._partitions[topic]

    async def _look_up(self) -> None:
        """Answer everyone waiting, round after round, until nobody is."""
        assert self._consumer is not None
        while self._waiting:
            waiting, self._waiting = self._waiting, {}
            try:
                ends = await self._consumer.end_offsets(list(waiting))
            except Exception as error:
                for waiters in waiting.values():
                    for waiter in waiters:
                        if not waiter.done():
                            waiter.set_exception(error)
                continue
            for tp, waiters in waiting.items():
                for waiter in waiters:
                    if not waiter.done():
                        waiter.set_result(ends[tp])
