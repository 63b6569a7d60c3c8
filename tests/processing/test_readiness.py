"""A processor's readiness (`/readyz`): once its assignment is taken and every partition of
it handles commands, also when the group gave it none."""

from __future__ import annotations

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
