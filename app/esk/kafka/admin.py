"""Admin requests that ride out a broker that is down.

aiokafka's admin client sends each request to one broker, chosen from its metadata: a
random one, the one named as controller (topic creation), or a group's coordinator. For
some seconds after a broker dies, until the cluster's controller has fenced it, the
metadata still names it, and a request sent to it fails at once (NodeNotReadyError, a
connection error) or after the request timeout. The client refreshes its metadata on such
a failure, so the same request asked again soon goes to a broker that answers.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from aiokafka.errors import KafkaError

from .errors import broker_away

log = logging.getLogger(__name__)
T = TypeVar("T")

RETRY_PAUSE_S = 0.2


async def retry_while_brokers_fail(operation: Callable[[], Awaitable[T]], timeout_s: float = 60.0, expected: bool = False) -> T:
    """`operation()` (one admin request, or a few), asked again while it fails for want of
    a broker (`errors.broker_away`), for up to `timeout_s`; `expected`: such a failure is
    what the caller waits out (a new cluster's coordinators), not news."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    told = False
    while True:
        try:
            return await operation()
        except (KafkaError, TimeoutError) as error:
            if not broker_away(error) or loop.time() > deadline:
                raise
            # once: a cluster without a quorum fails it five times a second for the whole wait
            log.log(logging.DEBUG if told or expected else logging.INFO, "admin request failed (%r); asking again for up to %.0f s", error, timeout_s)
            told = True
        await asyncio.sleep(RETRY_PAUSE_S)
