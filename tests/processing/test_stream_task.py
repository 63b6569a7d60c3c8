"""StreamTask against the real broker: commands are handled while the previous batch's
transaction is in flight, a failed commit takes the batch built on top of it down too, and
a task resumes from the position its last transaction recorded."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import orjson
import pytest
from aiokafka import TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError

from esk.kafka.client_options import client_options
from esk.kafka.reader import read_committed
from esk.kafka.topics import TopicNames, ensure_topics, topic_specs
from esk.metrics import COMMANDS
from esk.processing.processor import Processor
from esk.processing.stream_task import StreamTask
from esk.protocol import CommandEnvelope, StoredAggregate, aggregate_key, position_key
from esk.registry import load_registry
from esk.settings import Settings
from esk.state.store import RocksDBStore
from tests.system import command_record, system, task_builders, wait_for

pytestmark = pytest.mark.kafka

OPEN = CommandEnvelope("c-open", "accounts", "a1", "open", {"owner": "ada"})
DEPOSIT = CommandEnvelope("c-deposit", "accounts", "a1", "deposit", {"amount": 5})


async def _outcomes(settings: Settings) -> list[tuple[str, str, int]]:
    """Every committed outcome, by version."""
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
    task_partition = await processor.task_manager.build(0)
    task = task_partition.running
    accepted_before = COMMANDS.labels("accounts", "accepted")._value.get()
    try:
        task.process([command_record(commands, 0, OPEN)])
        first = asyncio.create_task(task_partition.commit())
        await asyncio.sleep(0)  # the commit has sealed the batch and is talking to the broker
        assert task.pending_commands == 0 and not first.done()
        task.process([command_record(commands, 1, DEPOSIT)])  # needs the account the open batch created
        await first
        assert _version(task) == 1 and task.committed_offset == 1
        await task_partition.commit()
        assert _version(task) == 2 and task.committed_offset == 2
        assert COMMANDS.labels("accounts", "accepted")._value.get() == accepted_before + 2
    finally:
        await task_partition.close()
    assert await _outcomes(settings) == [("c-open", "accepted", 1), ("c-deposit", "accepted", 2)]


async def test_a_failed_commit_discards_the_batch_handled_on_top_of_it(settings: Settings, processor: Processor) -> None:
    commands = TopicNames(settings.app).commands
    task_partition = await processor.task_manager.build(0)
    task = task_partition.running

    async def broken_commit() -> None:
        raise KafkaError("the broker went away mid-commit")

    task_partition.producer._producer.commit_transaction = broken_commit  # type: ignore[union-attr,method-assign]
    try:
        task.process([command_record(commands, 0, OPEN)])
        first = asyncio.create_task(task_partition.commit())
        await asyncio.sleep(0)
        task.process([command_record(commands, 1, DEPOSIT)])  # read the open that never commits
        with pytest.raises(KafkaError):
            await first
        with pytest.raises(RuntimeError, match="closed"):
            await task_partition.commit()  # the deposit must not commit on its own
        assert _version(task) is None and task.committed_offset == 0
    finally:
        await task_partition.close()

    # The next task for the partition (what the processor builds after a failure) fences
    # the open transaction and handles both commands again, from the committed offset.
    again_partition = await processor.task_manager.build(0)
    again = again_partition.running
    try:
        assert again.next_offset == 0
        again.process([command_record(commands, 0, OPEN)])
        again.process([command_record(commands, 1, DEPOSIT)])
        await again_partition.commit()
        assert _version(again) == 2
    finally:
        await again_partition.close()
    assert await _outcomes(settings) == [("c-open", "accepted", 1), ("c-deposit", "accepted", 2)]


async def test_a_task_resumes_from_the_position_in_the_changelog_ahead_of_the_group_offset(
    settings: Settings, processor: Processor
) -> None:
    """Every transaction records the task's position in the changelog; the group's offset
    is committed only now and then. A task whose store was lost resumes from the restored
    position, not from the group's (here: none), and its final commit brings the group up."""
    commands = TopicNames(settings.app).commands
    processor.settings.processor.group_offset_interval_ms = 3_600_000
    task_partition = await processor.task_manager.build(0)
    task = task_partition.running
    try:
        task.process([command_record(commands, 0, OPEN)])
        await task_partition.commit()
        task.process([command_record(commands, 1, DEPOSIT)])
        await task_partition.commit()
        assert task.committed_offset == 2 and task_partition.group_offset is None
    finally:
        await task_partition.close()
    changelog = await read_committed(settings, TopicNames(settings.app).changelog)
    assert [r.value for r in changelog if r.key == position_key(0)] == [b"1", b"2"]
    consumer = processor.task_manager.consumer
    assert consumer is not None
    assert await consumer.committed(TopicPartition(commands, 0)) is None

    RocksDBStore.destroy(processor.directory.store_path(0))
    again_partition = await processor.task_manager.build(0)
    again = again_partition.running
    try:
        assert again.next_offset == 2 and _version(again) == 2
        await again_partition.commit(final=True)  # nothing pending: a transaction with the group's offset only
        assert again_partition.group_offset == 2
    finally:
        await again_partition.close()
    assert await consumer.committed(TopicPartition(commands, 0)) == 2
    assert await _outcomes(settings) == [("c-open", "accepted", 1), ("c-deposit", "accepted", 2)]


async def test_the_group_offset_of_an_idle_partition_catches_up(settings: Settings) -> None:
    """Lag monitoring reads the group's committed offsets: once the commands stop, they
    reach the end of every partition within about group_offset_interval_ms."""
    settings.processor.group_offset_interval_ms = 200
    names = TopicNames(settings.app)
    async with system(settings) as s:
        for n in range(12):
            r = await s.client.post(f"/v1/accounts/idle-{n}/open", json={"owner": "ada"})
            assert r.status_code == 200
        ends: dict[int, int] = {}
        for record in await read_committed(settings, names.commands):
            ends[record.partition] = max(ends.get(record.partition, 0), record.offset + 1)
        admin = AIOKafkaAdminClient(**client_options(settings))
        await admin.start()
        committed: dict[int, int] = {}

        async def caught_up() -> bool:
            offsets = await admin.list_consumer_group_offsets(s.processors[0].processor.group_id)
            committed.clear()
            committed.update((tp.partition, o.offset) for tp, o in offsets.items() if tp.topic == names.commands)
            return all(committed.get(p) == end for p, end in ends.items())

        try:
            await wait_for(caught_up, timeout_s=10, what="the group's offsets at the end of every partition")
            assert {p: committed.get(p) for p in ends} == ends
        finally:
            await admin.close()
