"""StreamsProducer: the transactional producer of one task, and every aiokafka workaround
the processor's transactions need, in one place.

aiokafka speaks the transaction protocol from before KIP-447, so fencing rests on the
transactional id alone: one producer per commands partition with a stable id
(`<group>.<partition>`). `start` runs init_transactions, which bumps the id's epoch,
aborts what a previous owner left open, and makes that owner's next transactional request
fail with ProducerFenced.

A commit is four numbered steps: (1) begin, (2) the records, as record batches
(RecordCollector), (3) the consumer group's offsets, when asked for, (4) commit. A failure
at any step aborts the transaction explicitly, so its partitions' last stable offset moves
on at once rather than when the transaction times out; then the error goes to the caller.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import aiokafka.producer.sender
from aiokafka import AIOKafkaProducer, TopicPartition
from aiokafka.errors import ProducerFenced

from ..kafka.client_options import client_options
from ..settings import Settings
from .record_collector import MAX_BATCH_BYTES, Output, RecordCollector

log = logging.getLogger(__name__)

# Between two transactions of one producer the broker is still writing the first one's
# markers for a few milliseconds; a transaction begun then has its AddPartitionsToTxn
# refused with CONCURRENT_TRANSACTIONS, which aiokafka retries after a fixed 20 ms
# (`BACKOFF_OVERRIDE`, KAFKA-5477), not a setting. A task commits batch after batch and
# an HTTP client waits for each commit, so esk retries sooner (docs/benchmarks.md, probes).
CONCURRENT_TRANSACTIONS_RETRY_S = 0.005
ABORT_TIMEOUT_S = 10.0
_LET_GO: set[asyncio.Future[None]] = set()  # producers' stops under way


def _retry_concurrent_transactions_sooner() -> None:
    if not hasattr(aiokafka.producer.sender, "BACKOFF_OVERRIDE"):
        log.warning("aiokafka has no BACKOFF_OVERRIDE; transactions keep its own retry after CONCURRENT_TRANSACTIONS")
        return
    aiokafka.producer.sender.BACKOFF_OVERRIDE = CONCURRENT_TRANSACTIONS_RETRY_S


class StreamsProducer:
    """Make it inside the running loop (aiokafka clients bind to it), then `start` it."""

    def __init__(self, settings: Settings, transactional_id: str, client_id: str) -> None:
        _retry_concurrent_transactions_sooner()
        self.transactional_id = transactional_id
        self.transaction_timeout_ms = settings.processor.transaction_timeout_ms
        self._producer = AIOKafkaProducer(
            **client_options(settings),
            client_id=client_id,
            transactional_id=transactional_id,
            enable_idempotence=True,
            acks="all",
            linger_ms=2,
            max_batch_size=MAX_BATCH_BYTES,
            transaction_timeout_ms=self.transaction_timeout_ms,
        )
        self._collector = RecordCollector(self._producer)
        self._stop: asyncio.Future[None] | None = None

    async def start(self) -> None:
        """Connect and init_transactions: the previous owner of the id is fenced from here on."""
        await self._producer.start()

    async def stop(self) -> None:
        """Deliver what it holds, then close. Cancelled (`let_go`), it goes on in the background."""
        await asyncio.shield(self._stopping())

    def let_go(self) -> None:
        """Stop without waiting for it: aiokafka's `stop` first delivers the records it
        holds, for as long as their broker is away (its sender, even cancelled, waits on
        every request in flight). It goes on in the background until they are delivered,
        or refused once the next owner's `start` has fenced it, or the process ends."""
        self._stopping()

    def _stopping(self) -> asyncio.Future[None]:
        if self._stop is None:
            self._stop = asyncio.ensure_future(self._stopped())
            _LET_GO.add(self._stop)  # held until stopped: the loop keeps weak references only
            self._stop.add_done_callback(_LET_GO.discard)
        return self._stop

    async def _stopped(self) -> None:
        try:
            await self._producer.stop()
        except Exception as error:
            # A producer let go whose last request (its commit, say) met the next owner's
            # fence: aiokafka's stop raises that before it closes the connections.
            level = logging.INFO if isinstance(error, ProducerFenced) else logging.WARNING
            log.log(level, "%s: its stop ended with %r; its connections are closed", self.transactional_id, error)
            await self._producer.client.close()

    async def commit(
        self, outputs: Sequence[Output], consumed: dict[TopicPartition, int] | None, group_id: str
    ) -> dict[TopicPartition, int]:
        """Write `outputs` and, if given, the group's `consumed` offsets in one transaction;
        return the offset of the last record written to each partition."""
        await self._producer.begin_transaction()  # 1
        try:
            written = await self._collector.send(outputs)  # 2
            if consumed:
                await self._producer.send_offsets_to_transaction(consumed, group_id)  # 3
            await self._producer.commit_transaction()  # 4
        except Exception as error:
            await self._abort(error)
            raise
        return written

    async def _abort(self, error: Exception) -> None:
        if isinstance(error, ProducerFenced):
            return  # the id belongs to a newer owner now: nothing of ours is left to abort
        try:
            await asyncio.wait_for(self._producer.abort_transaction(), ABORT_TIMEOUT_S)
        except Exception as abort_error:  # the producer may be past aborting (fatal error)
            log.warning("%s: could not abort after %r: %r", self.transactional_id, error, abort_error)
