"""Commit spacing, on a running processor: a task that was idle commits a command at once,
and commands that come while it must wait gather into one transaction that begins no
sooner than `commit_spacing_ms` after the previous one began."""

from __future__ import annotations

import httpx
import pytest

from esk.kafka.reader import read_committed
from esk.kafka.topics import TopicNames
from esk.protocol import POSITION_PREFIX
from esk.settings import Settings
from tests.system import system, wait_for

pytestmark = pytest.mark.kafka

# Long enough for the open's answer and both deposits to come within it on a busy machine:
# the two deposits then share a transaction.
SPACING_MS = 3000


async def test_commands_that_come_during_the_spacing_share_one_transaction(settings: Settings) -> None:
    settings = settings.model_copy(
        update={
            "processor": settings.processor.model_copy(
                # no transaction but the commands' own: the group's offsets stay out of it
                update={"commit_spacing_ms": SPACING_MS, "group_offset_interval_ms": 3_600_000}
            )
        }
    )
    names = TopicNames(settings.app)
    async with system(settings) as running:
        client = running.clients[0]
        assert (await client.post("/v1/accounts/s1/open", json={"owner": "o"})).status_code == 200
        for _ in range(2):
            r = await client.post("/v1/accounts/s1/deposit", json={"amount": 5}, headers={"Prefer": "respond-async"})
            assert r.status_code == 202
        await wait_for(lambda: _balance(client), what="both deposits applied")
        # read before the processor stops: its last commit adds a transaction of its own
        commands = await read_committed(settings, names.commands)
        outcomes = sorted((r.timestamp, r.value) for r in await read_committed(settings, names.results))
        positions = [r for r in await read_committed(settings, names.changelog) if r.key.startswith(POSITION_PREFIX)]
    assert len(commands) == 3 and len(outcomes) == 3
    # one position record per transaction: the open's, then the two deposits' together
    assert len(positions) == 2
    opened, deposited = outcomes[0][0], outcomes[1][0]
    assert opened - commands[0].timestamp < SPACING_MS  # an idle task does not wait
    assert deposited - opened >= SPACING_MS - 100  # record times are set just after a transaction begins


async def _balance(client: httpx.AsyncClient) -> bool:
    r = await client.get("/v1/accounts/s1")
    return r.status_code == 200 and r.json()["state"]["balance"] == 10
