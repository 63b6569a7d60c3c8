"""G6: a processor that lost a partition can no longer commit for it."""

from __future__ import annotations

import asyncio
import gc
import signal
import uuid
from pathlib import Path

import orjson
import pytest
from aiokafka import TopicPartition
from aiokafka.errors import IllegalOperation, ProducerFenced

from bench import crash
from bench.cluster import Cluster, api_ready, wait_until
from esk.kafka.reader import read_committed
from esk.kafka.topics import TopicNames, ensure_topics, topic_specs
from esk.processing.record_collector import Output
from esk.processing.streams_producer import StreamsProducer
from esk.protocol import CommandEnvelope, aggregate_key
from esk.registry import load_registry
from esk.runtime import told_fences_quiet
from esk.settings import Settings
from tests.system import command_record, task_builders

pytestmark = pytest.mark.kafka


async def test_the_old_owner_of_a_partition_cannot_commit_after_the_new_one_started(settings: Settings) -> None:
    registry = load_registry(settings.domain)
    await ensure_topics(settings, topic_specs(settings, registry))
    names = TopicNames(settings.app)
    async with task_builders(settings, registry, "old", "new") as (old_owner, new_owner):
        envelope = CommandEnvelope("cmd-1", "accounts", "z1", "open", {"owner": "zed"})
        old_partition = await old_owner.task_manager.build(0)
        old = old_partition.running
        old.process([command_record(names.commands, 0, envelope)])  # handled, not yet committed ...
        new_partition = await new_owner.task_manager.build(0)
        new = new_partition.running  # ... when the partition moves on
        with pytest.raises(Exception) as fenced:
            await old_partition.commit()
        print("old owner's commit failed with", repr(fenced.value))
        assert old.store.get(aggregate_key("accounts", "z1")) is None  # RocksDB untouched
        await old_partition.close()

        new.process([command_record(names.commands, 0, envelope)])
        await new_partition.commit()
        await new_partition.close()
        events = [orjson.loads(r.value) for r in await read_committed(settings, names.events("accounts"))]
        assert [(e["aggregate_id"], e["type"], e["version"]) for e in events] == [("z1", "Opened", 1)]


async def test_a_partition_taken_away_while_its_commit_fails_tells_that_commit_s_failure(
    settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    """Revoked while its commit in flight is fenced: the commit loop leaves a partition
    already taken away to its close to tell, and the close told only that its own final
    commit found the partition closed (a trial's SIGSTOP/SIGCONT: "final commit failed
    (RuntimeError('partition 3 is closed'))"), not why."""
    registry = load_registry(settings.domain)
    await ensure_topics(settings, topic_specs(settings, registry))
    names = TopicNames(settings.app)
    async with task_builders(settings, registry, "old", "new") as (old_owner, new_owner):
        old_partition = await old_owner.task_manager.build(0)
        old_owner.task_manager.partitions[0] = old_partition
        old_partition.running.process([command_record(names.commands, 0, CommandEnvelope("cmd-1", "accounts", "z1", "open", {"owner": "zed"}))])
        new_partition = await new_owner.task_manager.build(0)  # the old owner is fenced
        in_flight = asyncio.create_task(old_partition.commit())
        await asyncio.sleep(0)  # it holds the commit lock
        caplog.clear()
        await old_owner.task_manager.revoke({0})
        # The fence, as aiokafka meets it: on the request that finds it, or, when another of
        # its requests found it first, on a send the aborted transaction no longer takes.
        with pytest.raises((ProducerFenced, IllegalOperation)) as failed:
            await in_flight
        await new_partition.close()
    [told] = [r.getMessage() for r in caplog.records if "partition 0:" in r.getMessage()]
    assert told.startswith(f"partition 0: last commit failed ({type(failed.value).__name__}("), told


def test_a_fence_is_told_where_it_is_met_and_not_again_by_asyncio(settings: Settings, caplog: pytest.LogCaptureFixture) -> None:
    """A transactional producer fenced by a newer owner of its id, as its transaction adds
    a partition or the group's offsets: the commit raises it (esk tells it there), and the
    event loop of esk's processes does not log it again, an ERROR with a traceback, when
    the futures aiokafka left it on are collected."""
    gc.collect()  # what earlier tests left behind is theirs
    caplog.clear()

    async def fenced_twice() -> None:
        asyncio.get_running_loop().set_exception_handler(told_fences_quiet)  # as esk's processes run
        registry = load_registry(settings.domain)
        await ensure_topics(settings, topic_specs(settings, registry))
        names = TopicNames(settings.app)
        for outputs, offsets in (
            ([Output(names.commands, b"k", b"v", partition=0)], None),  # fenced adding the partition
            ([], {TopicPartition(names.commands, 0): 1}),  # fenced adding the offsets
        ):
            transactional_id = f"{settings.app}.fence-{uuid.uuid4().hex}"
            old, new = StreamsProducer(settings, transactional_id, "old"), StreamsProducer(settings, transactional_id, "new")
            await old.start()
            await new.start()
            try:
                with pytest.raises(ProducerFenced):
                    await old.commit(outputs, offsets, f"{settings.app}.fence-test")
            finally:
                await old.stop()
                await new.stop()
            del old
            gc.collect()  # in this loop: the futures are its own

    asyncio.run(fenced_twice())
    assert "exception was never retrieved" not in caplog.text, caplog.text


async def test_a_frozen_processor_gives_its_partitions_up_and_commits_nothing(settings: Settings, tmp_path: Path) -> None:
    """SIGSTOP a processor until its partitions move to another, then SIGCONT it."""
    registry = load_registry(settings.domain)
    await ensure_topics(settings, topic_specs(settings, registry))
    cluster = Cluster(settings, tmp_path / "cluster")
    fast = {"ESK_PROCESSOR__SESSION_TIMEOUT_MS": "6000"}
    api, frozen, other = cluster.api("api"), cluster.processor("frozen", **fast), cluster.processor("other", **fast)
    partitions = settings.topics.partitions
    try:
        api.start()
        frozen.start()
        url = f"http://127.0.0.1:{api.port}"
        await asyncio.to_thread(wait_until, lambda: api_ready(url), 60, "API ready")
        await asyncio.to_thread(wait_until, lambda: frozen.metric("esk_active_tasks") == partitions, 60, "frozen owns all")
        load = crash.Load(url, [f"acc-{n}" for n in range(30)], rate=60, seed=5)
        driving = asyncio.create_task(load.run())
        await asyncio.sleep(1)
        other.start()
        await asyncio.to_thread(
            wait_until, lambda: (other.metric("esk_active_tasks") or 0) > 0, 60, "the partitions to be shared"
        )
        frozen.signal(signal.SIGSTOP)
        await asyncio.to_thread(
            wait_until, lambda: other.metric("esk_active_tasks") == partitions, 60, "other to take over"
        )
        await asyncio.sleep(1)
        frozen.signal(signal.SIGCONT)
        await asyncio.sleep(3)  # the thawed processor notices it was left behind and rejoins
        load.stop()
        await driving
        assert frozen.alive, frozen.log_text()[-3000:]
        verdict = await crash.verify(settings, url, load.acknowledged)
        assert verdict.ok, verdict
        assert verdict.acknowledged > 150
        # the group settles with every partition owned once, the thawed processor included
        await asyncio.to_thread(
            wait_until,
            lambda: (frozen.metric("esk_active_tasks") or 0) + (other.metric("esk_active_tasks") or 0) == partitions,
            60,
            "the group to settle",
        )
        assert frozen.alive
    finally:
        cluster.stop_all()
