"""esk_commands_lag: the processor reports, for each commands partition it runs, how many
commands wait to be handled; a partition it gives up leaves no sample behind."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from aiokafka import AIOKafkaProducer
from prometheus_client import REGISTRY

from esk.kafka.client_options import client_options
from esk.kafka.topics import TopicNames
from esk.metrics import COMMANDS_LAG, RESTORE_RATE, RESTORE_REMAINING, UNUSABLE_AGGREGATES, forget_partitions
from esk.protocol import CommandEnvelope
from esk.settings import Settings
from tests.system import system, wait_for

pytestmark = pytest.mark.kafka


def lag(partition: int) -> float | None:
    value: float | None = REGISTRY.get_sample_value("esk_commands_lag", {"partition": str(partition)})
    return value


async def test_each_running_partition_reports_its_lag(settings: Settings) -> None:
    forget_partitions(range(settings.topics.partitions))  # what earlier tests' processors left
    async with system(settings) as running:
        for n in range(12):  # accounts on every partition
            answer = await running.client.post(f"/v1/accounts/lag{n}/open", json={"owner": "o"}, headers={"Prefer": "respond-async"})
            assert answer.status_code == 202
        await wait_for(lambda: all(lag(p) == 0 for p in range(settings.topics.partitions)), what="every partition caught up")
        # A reactor's command, written in a transaction: its commit marker takes the offset
        # after it, and holds no command to handle (the partition read 1 behind for ever).
        producer = AIOKafkaProducer(**client_options(settings), transactional_id=f"reactor-{uuid.uuid4()}")
        await producer.start()
        try:
            async with producer.transaction():
                command = CommandEnvelope(f"reacted-{uuid.uuid4()}", "accounts", "lag0", "deposit", {"amount": 1, "note": ""})
                await producer.send_and_wait(TopicNames(settings.app).commands, command.encode(), key=command.key)
        finally:
            await producer.stop()
        handled = await running.client.get(f"/v1/commands/{command.command_id}", params={"wait_ms": 30_000}, timeout=40)
        assert handled.status_code == 200, handled.text
        await asyncio.sleep(1)  # the processor's next polls report its partition's lag
        await wait_for(lambda: all(lag(p) == 0 for p in range(settings.topics.partitions)), what="every partition caught up again")


def test_a_partition_given_up_leaves_no_sample() -> None:
    COMMANDS_LAG.labels("97").set(5)
    UNUSABLE_AGGREGATES.labels("97").set(1)
    RESTORE_REMAINING.labels("processor", "97").set(1000)
    RESTORE_RATE.labels("rebuilding", "97").set(10)
    COMMANDS_LAG.labels("98").set(7)
    forget_partitions([97, 99])  # 99: never reported
    assert lag(97) is None and REGISTRY.get_sample_value("esk_restore_remaining_records", {"role": "processor", "partition": "97"}) is None
    assert REGISTRY.get_sample_value("esk_unusable_aggregates", {"partition": "97"}) is None
    assert REGISTRY.get_sample_value("esk_restore_records_per_second", {"role": "rebuilding", "partition": "97"}) is None
    assert lag(98) == 7, "the partitions it keeps are untouched"
    forget_partitions([98])
