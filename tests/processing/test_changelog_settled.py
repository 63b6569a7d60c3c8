"""A partition's restore waits while a transaction is open on its changelog: the restore
reads committed records up to the first open transaction, so a commit behind it would be
restored without, and its commands handled again once the next commit marks it. After the
previous owner is fenced none is open, unless a broker lost its markers (Kafka 4.1 to 4.4,
KAFKA-20734), which leaves it open for good: the partition waits, saying so, rather than
doubling events. Against the real broker, with a transaction left open on purpose."""

from __future__ import annotations

import asyncio
import logging

import pytest
from aiokafka import AIOKafkaProducer

from esk.kafka.client_options import client_options
from esk.kafka.topics import TopicNames, ensure_topics, topic_specs
from esk.processing import task_manager
from esk.processing.task_manager import TaskManager
from esk.registry import load_registry
from esk.settings import Settings
from esk.state.directory import StateDirectory
from esk.state.resources import StoreResources


@pytest.mark.kafka
async def test_a_partition_waits_while_a_transaction_is_open_on_its_changelog(
    settings: Settings, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    registry = load_registry(settings.domain)
    await ensure_topics(settings, topic_specs(settings, registry))
    topics = TopicNames(settings.app)
    manager = TaskManager(
        settings, registry, StateDirectory(settings.processor.state_dir, topics.commands), StoreResources(64), "group"
    )
    monkeypatch.setattr(task_manager, "CHANGELOG_SETTLE_WARN_S", 1.0)
    await asyncio.wait_for(manager._changelog_settled(0), 10)  # nothing open: at once

    left_open = AIOKafkaProducer(**client_options(settings), transactional_id=f"{settings.app}.left-open")
    await left_open.start()
    try:
        await left_open.begin_transaction()
        await (await left_open.send(topics.changelog, b"v", key=b"k", partition=0))
        with caplog.at_level(logging.ERROR, logger="esk.processing.task_manager"):
            waiting = asyncio.create_task(manager._changelog_settled(0))
            await asyncio.sleep(2.5)
            assert not waiting.done()
            assert f"partition 0: a transaction open on {topics.changelog} from offset 0 (its end is 1)" in caplog.text
            await asyncio.wait_for(manager._changelog_settled(1), 10)  # another partition goes on
            await left_open.abort_transaction()
            await asyncio.wait_for(waiting, 10)
    finally:
        await left_open.stop()
