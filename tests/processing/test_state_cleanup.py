"""A processor removes the stores of partitions it gave up, once they stayed given up for
`state_cleanup_delay_s`, and keeps its standby copies: against the real broker, two
processors sharing the partitions."""

from __future__ import annotations

import asyncio

import pytest

from esk.settings import Settings
from tests.system import first_processor, processor, processors_domain, sharing, wait_for, with_state_dirs

pytestmark = pytest.mark.kafka


@pytest.mark.parametrize("standby_replicas", [0, 1])
async def test_the_stores_of_partitions_given_up_go_after_the_delay_and_standby_copies_stay(
    settings: Settings, standby_replicas: int
) -> None:
    settings, registry = await processors_domain(settings, standby_replicas=standby_replicas, state_cleanup_delay_s=1.0)
    partitions = set(range(settings.topics.partitions))
    async with first_processor(settings, registry, 9) as (client, first, accounts):
        directory = first.processor.directory
        assert directory.partitions_on_disk() == partitions
        async with processor(with_state_dirs(settings, "p1"), registry) as second:
            await wait_for(lambda: sharing(first, second, partitions), what="both processors own partitions")
            kept, given_up = set(first.processor.tasks), partitions - set(first.processor.tasks)
            if standby_replicas:
                # kept warm as standby copies: they stay however long
                await wait_for(lambda: first.processor.standbys.partitions == given_up, what="standby copies")
                await asyncio.sleep(3)  # three times the delay
                assert directory.partitions_on_disk() == partitions
            else:
                await wait_for(lambda: directory.partitions_on_disk() == kept, 30, "the stores given up removed")
                await wait_for(lambda: directory.set_aside_earlier() == [], 10, "the stores deleted")
            for account in accounts:
                assert (await client.post(f"/v1/accounts/{account}/deposit", json={"amount": 1})).status_code == 200
        # the second gone, the first takes every partition back: restored from the
        # changelog where its store went, and the states are whole
        await wait_for(lambda: first.processor.ready and set(first.processor.tasks) == partitions, 60, "all partitions back")
        for account in accounts:
            r = await client.post(f"/v1/accounts/{account}/deposit", json={"amount": 1})
            assert r.status_code == 200 and r.json()["version"] == 3, r.text
            assert (await client.get(f"/v1/accounts/{account}")).json()["state"]["balance"] == 2
        assert directory.partitions_on_disk() == partitions

