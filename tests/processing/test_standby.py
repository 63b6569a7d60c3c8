"""Standby replicas: a processor keeps warm copies of the partitions another owns, and
takes them over with (almost) nothing to restore. Without standbys the same failover
replays the partitions' whole changelog: the contrast is the point."""

from __future__ import annotations

import logging

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition

from esk.kafka.reader import committed_reader
from esk.settings import Settings
from tests.system import RunningProcessor, first_processor, processor, processors_domain, sharing, wait_for, with_state_dirs

pytestmark = pytest.mark.kafka


async def _caught_up(standby: RunningProcessor, reader: AIOKafkaConsumer) -> bool:
    """A restore from each of the standby's copies would replay nothing: each is at its
    changelog partition's committed end (past the last transaction marker)."""
    copies = standby.processor.standbys.offsets()
    ends = await reader.end_offsets([TopicPartition(standby.processor.topics.changelog, p) for p in copies])
    return bool(copies) and all(copies[tp.partition] == end for tp, end in ends.items())


@pytest.mark.parametrize("standby_replicas", [0, 1])
async def test_failover_replays_only_what_no_standby_kept(
    settings: Settings, standby_replicas: int, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="esk.processing.standby")
    settings, registry = await processors_domain(settings, standby_replicas=standby_replicas)
    partitions = set(range(settings.topics.partitions))
    async with first_processor(settings, registry, 12) as (client, first, accounts):
        async with processor(with_state_dirs(settings, "p1"), registry) as second:
            await wait_for(lambda: sharing(first, second, partitions), what="both processors own partitions")
            for account in accounts:  # live traffic the standbys must follow
                r = await client.post(f"/v1/accounts/{account}/deposit", json={"amount": 5})
                assert r.status_code == 200 and r.json()["version"] == 2
            moved = set(first.processor.tasks)
            if standby_replicas:
                assert second.processor.standbys.partitions == moved
                reader = committed_reader(settings)
                await reader.start()
                try:
                    await wait_for(lambda: _caught_up(second, reader), what="standby copies caught up")
                finally:
                    await reader.stop()
            else:
                assert second.processor.standbys.partitions == set()

            await first.shutdown()
            await wait_for(
                lambda: second.processor.ready and set(second.processor.tasks) == partitions,
                what="the survivor owns every partition",
            )
            replayed = sum(second.processor.restores[p].restored for p in moved)
            # What the first would tell the group's leader of the copies it gave up, should it
            # join again: each as far along as the changelog (closed at its clean stop).
            reader = committed_reader(settings)
            await reader.start()
            try:
                ends = await reader.end_offsets([TopicPartition(first.processor.topics.changelog, p) for p in moved])
            finally:
                await reader.stop()
            copies = first.processor.directory.copies_on_disk()
            for tp, end in ends.items():  # past its last record, or past the commit marker after it too
                assert end - 1 <= copies[tp.partition] <= end, (tp, copies, ends)
            if standby_replicas:
                assert replayed == 0
                # its copies all became its own: the log says it keeps none now
                assert "standby for no partition now" in [r.getMessage() for r in caplog.records]
            else:
                assert replayed > 0  # the whole changelog of `moved`, from the beginning
            for account in accounts:  # and the state it took over is the right one
                r = await client.post(f"/v1/accounts/{account}/deposit", json={"amount": 1})
                assert r.status_code == 200 and r.json()["version"] == 3
                assert (await client.get(f"/v1/accounts/{account}")).json()["state"]["balance"] == 6
