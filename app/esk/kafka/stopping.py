"""Stopping an aiokafka consumer without its own cancellations escaping into the caller.

aiokafka's `AIOKafkaConsumer.stop` cancels the fetch requests in flight and awaits them;
one that was waiting out its retry backoff (a broker away) ends cancelled, and that
CancelledError comes out of `stop` (aio-libs/aiokafka#647): a SIGTERM during a broker
outage ended processes with a traceback and skipped what their shutdown does after the
consumer (closing the stores, the producers). Here it is told apart from a cancellation
of the caller itself, which still propagates.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from aiokafka import AIOKafkaConsumer

log = logging.getLogger(__name__)


async def stop_consumer(consumer: AIOKafkaConsumer) -> None:
    try:
        await consumer.stop()
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise  # the caller is being cancelled: not aiokafka's own
        log.debug("a fetch request cancelled by the consumer's stop ended it early; closing the rest")
        # `stop` ended at the first cancelled fetch: the others, and its last step, which
        # closes the client's connections, are done here (no public way to reach them).
        fetcher = consumer._fetcher
        if fetcher is not None:
            for task in [*fetcher._pending_tasks, fetcher._fetch_task]:
                task.cancel()
            await asyncio.gather(*fetcher._pending_tasks, fetcher._fetch_task, return_exceptions=True)
        with contextlib.suppress(Exception):
            await consumer._client.close()
