"""Where a command's outputs land, against the real broker: commands, events and outcomes
are keyed by aggregate id, so with equal partition counts everything about one aggregate
sits on one partition number of each topic, and a transaction touches one partition per
topic it writes."""

from __future__ import annotations

from collections import defaultdict

import orjson
import pytest

from esk.kafka.reader import read_committed
from esk.kafka.topics import TopicNames
from esk.protocol import aggregate_key
from esk.settings import Settings
from tests.system import events_topic, system

pytestmark = pytest.mark.kafka


async def test_an_aggregates_command_events_outcomes_and_changelog_share_a_partition(settings: Settings) -> None:
    names = TopicNames(settings.app)
    ids = [f"acc-{n}" for n in range(12)]
    async with system(settings) as s:
        for account in ids:
            assert (await s.clients[0].post(f"/v1/accounts/{account}/open", json={"owner": account})).status_code == 200
            assert (await s.clients[0].post(f"/v1/accounts/{account}/deposit", json={"amount": 5})).status_code == 200

    partitions: dict[str, dict[str, set[int]]] = defaultdict(lambda: defaultdict(set))
    for record in await read_committed(settings, names.commands):
        partitions[orjson.loads(record.value)["aggregate_id"]]["commands"].add(record.partition)
    for record in await read_committed(settings, events_topic(settings, "accounts")):
        partitions[orjson.loads(record.value)["aggregate_id"]]["events"].add(record.partition)
    for record in await read_committed(settings, names.results):
        partitions[orjson.loads(record.value)["aggregate_id"]]["results"].add(record.partition)
    by_store_key = {aggregate_key("accounts", account): account for account in ids}
    for record in await read_committed(settings, names.changelog):
        if record.key in by_store_key:
            partitions[by_store_key[record.key]]["changelog"].add(record.partition)

    assert set(partitions) == set(ids)
    for account in ids:
        assert set(partitions[account]) == {"commands", "events", "results", "changelog"}, account
        (command_partition,) = partitions[account]["commands"]
        for topic, found in partitions[account].items():
            assert found == {command_partition}, (account, topic, found)
    # 12 aggregates over the partitions: the check above is not vacuous on a single one
    assert len({min(p["commands"]) for p in partitions.values()}) > 1
