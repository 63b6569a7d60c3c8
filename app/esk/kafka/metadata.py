"""Topic metadata, asked of the brokers through the admin client's public API."""

from __future__ import annotations

import asyncio
import functools

from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import TopicAuthorizationFailedError

from ..settings import Settings
from .admin import retry_while_brokers_fail
from .client_options import client_options


class TopicMissing(LookupError):
    """A topic esk reads is not there: `esk topics init` has not run (or ran for other settings)."""


async def topic_partitions(settings: Settings, topic: str, timeout_s: float = 10.0) -> list[int]:
    """The partitions of `topic`; raises TopicMissing if it does not exist (after waiting a
    little: a topic just created shows up in every broker's metadata a moment later), and
    TopicAuthorizationFailedError if the principal may not describe it."""
    admin = AIOKafkaAdminClient(**client_options(settings))
    await admin.start()
    try:
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            [described] = await retry_while_brokers_fail(functools.partial(admin.describe_topics, [topic]))
            if described["error_code"] == 0 and described["partitions"]:
                return sorted(p["partition"] for p in described["partitions"])
            if described["error_code"] == TopicAuthorizationFailedError.errno:  # no wait makes it appear
                raise TopicAuthorizationFailedError(f"describing {topic}")
            if asyncio.get_running_loop().time() > deadline:
                raise TopicMissing(f"topic {topic} not found: run `esk topics init`")
            await asyncio.sleep(0.05)
    finally:
        await admin.close()
