"""Where an accepted command's events are (api/positions.py), against the real broker."""

from __future__ import annotations

import pytest
from aiokafka import AIOKafkaProducer, TopicPartition

from esk.api.positions import EventPositions
from esk.kafka.client_options import client_options
from esk.kafka.metadata import topic_partitions
from esk.kafka.partitioner import partition_for
from esk.kafka.reader import committed_reader
from esk.kafka.topics import TopicNames, ensure_topics, topic_specs
from esk.protocol import Outcome, Status
from esk.registry import load_registry
from esk.settings import Settings

pytestmark = pytest.mark.kafka


async def test_a_position_lies_past_the_command_s_events_before_their_partition_s_commit_marker(settings: Settings) -> None:
    """Kafka writes a transaction's commit markers partition by partition: a command's
    outcome can be read while its events partition's marker is still to come, and that
    partition's last stable offset then stands at or before the command's events. The
    answer's position must lie past them all the same, or a read given it shows the state
    from before the command."""
    await ensure_topics(settings, topic_specs(settings, load_registry(settings.domain)))
    topic = TopicNames(settings.app).events("accounts")
    partition = partition_for(b"acc-1", len(await topic_partitions(settings, topic)))
    positions = EventPositions(settings)
    await positions.start()
    # the processor's transaction as the API may find it: its events written, their
    # partition's marker not yet (the outcome below is what the API has read)
    producer = AIOKafkaProducer(**client_options(settings), transactional_id=f"{settings.app}-late-marker", enable_idempotence=True)
    await producer.start()
    try:
        await producer.begin_transaction()
        written = [await producer.send_and_wait(topic, b"{}", key=b"acc-1", partition=partition) for _ in range(2)]
        outcome = Outcome("c-1", "accounts", "acc-1", "deposit", Status.ACCEPTED, 2, [{"type": "Deposited"}], processed_at=0)
        position = await positions.of(outcome)
        assert position is not None and (position.topic, position.partition) == (topic, partition)
        assert position.offset > max(record.offset for record in written)
        # a reader (read_committed) gets there once the marker is written, not before
        assert await _stable_end(settings, topic, partition) < position.offset
        await producer.commit_transaction()
        assert await _stable_end(settings, topic, partition) >= position.offset
    finally:
        await producer.stop()
        await positions.stop()


async def _stable_end(settings: Settings, topic: str, partition: int) -> int:
    reader = committed_reader(settings)
    await reader.start()
    try:
        tp = TopicPartition(topic, partition)
        return (await reader.end_offsets([tp]))[tp]
    finally:
        await reader.stop()
