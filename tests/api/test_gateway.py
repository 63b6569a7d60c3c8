"""The API's way onto the commands topic, against the real broker: a producer that an
error it cannot retry has stopped is replaced, so the API takes commands again."""

from __future__ import annotations

import pytest
from aiokafka.errors import KafkaError

from esk.api.gateway import CommandGateway
from esk.kafka.topics import TopicNames, ensure_topics, topic_specs
from esk.protocol import CommandEnvelope
from esk.registry import load_registry
from esk.settings import Settings
from tests.system import read_topic

pytestmark = pytest.mark.kafka


def _deposit(command_id: str, note: str = "") -> CommandEnvelope:
    return CommandEnvelope(command_id, "accounts", "a1", "deposit", {"amount": 5, "note": note})


async def test_a_producer_stopped_by_an_error_it_cannot_retry_is_replaced(settings: Settings) -> None:
    await ensure_topics(settings, topic_specs(settings, load_registry(settings.domain)))
    gateway = CommandGateway(settings)
    await gateway.start()
    try:
        await gateway.submit(_deposit("before"))
        first = gateway._producer
        # larger than a request may be: no retry mends it (as none mends a sequence number
        # out of order once a broker came back, which ends an idempotent producer's sender)
        with pytest.raises(KafkaError) as failed:
            await gateway.submit(_deposit("too-large", "x" * 2_000_000))
        assert not failed.value.retriable
        await gateway.submit(_deposit("after"))
        assert gateway._producer is not None and gateway._producer is not first
    finally:
        await gateway.stop()
    stored = [value["command_id"] for _, value, _ in await read_topic(settings, TopicNames(settings.app).commands)]
    assert stored == ["before", "after"]
