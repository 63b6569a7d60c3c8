"""StreamTask against the real broker: commands are handled while the previous batch's
transaction is in flight, and a failed commit takes the batch built on top of it down too."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import orjson
import pytest
from aiokafka.errors import KafkaError

from app.kafka.reader import read_committed
from app.kafka.topics import TopicNames, ensure_topics, topic_specs
from app.metrics import COMMANDS
from app.processing.processor import Processor
from app.processing.stream_task import StreamTask
from app.protocol import CommandEnvelope, StoredAggregate, aggregate_key
from app.registry import load_registry
from app.settings import Settings
from tests.system import command_record, task_builders

pytestmark = pytest.mark.kafka

OPEN = CommandEnvelope("c-open", "accounts", "a1", "open", {"owner": "ada"})
DEPOSIT = CommandEnvelope("c-deposit", "accounts", "a1", "deposit", {"amount": 5})


async def _outcomes(settings: Settings) -> list[tuple[str, str, int]]:
    """Every committed outcome, by version (the results topic is keyed by command id, so
    the two land on different partitions)."""
    records = await read_committed(settings, TopicNames(settings.app).results)
    return sorted(((o["command_id"], o["status"], o["version"]) for o in (orjson.loads(r.value) for r in records)), key=lambda o: o[2])


@pytest.fixture
async def processor(settings: Settings) -> AsyncIterator[Processor]:
    """A processor whose tasks the test builds and drives by hand, on this test's topics."""
    registry = load_registry(settings.domain)
    await ensure_topics(settings, topic_specs(settings, registry))
    async with task_builders(settings, registry, "p") as (built,):
        yield built


def _version(task: StreamTask) -> int | None:
    raw = task.store.get(aggregate_key("accounts", "a1"))
    return StoredAggregate.decode(raw).version if raw is not None else None


async def test_a_command_handled_during_a_commit_sees_the_batch_in_flight(settings: Settings, processor: Processor) -> None:
    commands = TopicNames(settings.app).commands
    task = await processor._build_task(0)
    accepted_before = COMMANDS.labels("accounts", "accepted")._value.get()
    try:
        task.process([command_record(commands, 0, OPEN)])
        first = asyncio.create_task(task.commit())
        await asyncio.sleep(0)  # the commit has sealed the batch and is talking to the broker
        assert task.pending_commands == 0 and not first.done()
        task.process([command_record(commands, 1, DEPOSIT)])  # needs the account the open batch created
        await first
        assert _version(task) == 1 and task.committed_offset == 1
        await task.commit()
        assert _version(task) == 2 and task.committed_offset == 2
        assert COMMANDS.labels("accounts", "accepted")._value.get() == accepted_before + 2
    finally:
        await task.close()
    assert await _outcomes(settings) == [("c-open", "accepted", 1), ("c-deposit", "accepted", 2)]


async def test_a_failed_commit_discards_the_batch_handled_on_top_of_it(settings: Settings, processor: Processor) -> None:
    commands = TopicNames(settings.app).commands
    task = await processor._build_task(0)

    async def broken_commit() -> None:
        raise KafkaError("the broker went away mid-commit")

    task.producer.commit_transaction = broken_commit  # type: ignore[method-assign]
    try:
        task.process([command_record(commands, 0, OPEN)])
        first = asyncio.create_task(task.commit())
        await asyncio.sleep(0)
        task.process([command_record(commands, 1, DEPOSIT)])  # read the open that never commits
        with pytest.raises(KafkaError):
            await first
        with pytest.raises(RuntimeError, match="failed"):
            await task.commit()  # the deposit must not commit on its own
        assert _version(task) is None and task.committed_offset == 0
    finally:
        await task.close()

    # The next task for the partition (what the processor builds after a failure) fences
    # the open transaction and handles both commands again, from the committed offset.
    again = await processor._build_task(0)
    try:
        assert again.next_offset == 0
        again.process([command_record(commands, 0, OPEN)])
        again.process([command_record(commands, 1, DEPOSIT)])
        await again.commit()
        assert _version(again) == 2
    finally:
        await again.close()
    assert await _outcomes(settings) == [("c-open", "accepted", 1), ("c-deposit", "accepted", 2)]
