"""A processor's readiness (`/readyz`): once its assignment is taken and every partition of
it handles commands, also when the group gave it none."""

from __future__ import annotations

from typing import Any

import pytest

from esk.settings import Settings
from tests.system import processor, processors_domain, wait_for, with_state_dirs

pytestmark = pytest.mark.kafka


async def test_a_processor_the_group_gives_no_partition_is_ready_and_takes_over_when_one_leaves(settings: Settings) -> None:
    settings = settings.model_copy(update={"topics": settings.topics.model_copy(update={"partitions": 1})})
    settings, registry = await processors_domain(settings)
    async with processor(with_state_dirs(settings, "p0"), registry) as first:
        assert set(first.processor.tasks) == {0}
        async with processor(with_state_dirs(settings, "p1"), registry) as idle:  # waits for it to be ready
            await wait_for(lambda: first.processor.ready and idle.processor.ready, what="both processors ready after the rebalance")
            assert set(first.processor.tasks) == {0} and idle.processor.tasks == {}
            await first.shutdown()
            await wait_for(lambda: idle.processor.ready and set(idle.processor.tasks) == {0}, what="the idle one owns the partition")


def generation(running: Any) -> int:
    """The group generation the processor's consumer is in (aiokafka's coordinator keeps it)."""
    return int(running.processor.task_manager.consumer._coordinator.generation)


async def test_processors_join_their_group_in_one_rebalance_each(settings: Settings) -> None:
    # Each JoinGroup of other protocols than the member's last starts the group's rebalance
    # anew: two processors starting together went on so for minutes, neither ready.
    settings, registry = await processors_domain(settings)
    async with processor(with_state_dirs(settings, "p0"), registry) as first:
        assert generation(first) == 1  # a new group: its first member's first join
        async with processor(with_state_dirs(settings, "p1"), registry) as second:
            await wait_for(lambda: first.processor.ready and second.processor.ready, what="both processors ready after the rebalance")
            assert generation(first) == generation(second) == 2
