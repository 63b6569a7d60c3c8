"""The schemas of the event versions stored, recorded on `<app>.schemas` by the processors
that write them (esk.schema.recorded), against the real broker: a processor's code is held
to them whatever lock file it carries. The trial that found the need: a rollback reverted
the lock with the code, and a hotfix built from there gave `Repaid` v2 another shape than
the v2 events stored, which every check of the lock passed."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaProducer
from pydantic import BaseModel

from esk import AggregateType, Command, Event
from esk.kafka.client_options import client_options
from esk.kafka.reader import read_committed
from esk.kafka.topics import TopicNames, ensure_topics, topic_specs
from esk.registry import Registry
from esk.schema.lock import build_lock, write_lock
from esk.schema.recorded import SchemasContradicted, hold_to_recorded_schemas, recorded_schemas
from esk.settings import Settings

pytestmark = pytest.mark.kafka


class Open(Command):
    owner: str


class Till(BaseModel):
    owner: str


def tills(opened: type[Event], upcasters: dict[tuple[str, int], Any] | None = None) -> Registry:
    aggregate: AggregateType[Any] = AggregateType(
        name="tills", state=Till, commands={"open": Open}, creates=frozenset({Open}), events=[opened],
        decide=lambda state, command: [], evolve=lambda state, event: state, upcasters=upcasters or {},
    )  # fmt: skip
    return {"tills": aggregate}


def opened(version: int, **fields: type) -> type[Event]:
    """`Opened` at `version`, with `fields`."""
    return type("Opened", (Event,), {"__annotations__": fields, "schema_version": version})


RELEASE_1 = tills(opened(1, owner=str))
RELEASE_2 = tills(opened(2, first=str, last=str), {("Opened", 1): lambda d: {"first": d["owner"], "last": ""}})
HOTFIX = tills(opened(2, owner=str, currency=str), {("Opened", 1): lambda d: {**d, "currency": "EUR"}})  # from release 1


async def records(settings: Settings) -> int:
    return len(await read_committed(settings, TopicNames(settings.app).schemas))


async def test_a_processors_code_is_held_to_the_schemas_recorded_whatever_its_lock(
    settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    await ensure_topics(settings, topic_specs(settings, ["tills"]))
    await hold_to_recorded_schemas(settings, RELEASE_1, refuse=True)
    assert list(await recorded_schemas(settings)) == ["tills/Opened/1"]
    await hold_to_recorded_schemas(settings, RELEASE_1, refuse=True)  # the same code again: nothing new
    await hold_to_recorded_schemas(settings, RELEASE_2, refuse=True)
    assert sorted(await recorded_schemas(settings)) == ["tills/Opened/1", "tills/Opened/2"]
    assert await records(settings) == 2

    await hold_to_recorded_schemas(settings, RELEASE_1, refuse=True)  # a rollback writes v1 as it was
    with pytest.raises(SchemasContradicted) as refused:
        await hold_to_recorded_schemas(settings, HOTFIX, refuse=True)
    told = refused.value.told
    assert f"tills event Opened v2: new required field `owner`, against the v2 events stored (their schema is recorded on {settings.app}.schemas by the processor that wrote them)" in told
    assert any(line.startswith("tills event Opened v2: field `first` removed") for line in told), told

    # esk dev's processor only warns, and leaves the record of the stored shape as it is
    caplog.set_level(logging.WARNING, logger="esk.schema.recorded")
    await hold_to_recorded_schemas(settings, HOTFIX, refuse=False)
    assert "tills event Opened v2: new required field `owner`" in caplog.text
    assert await records(settings) == 2
    recorded = await recorded_schemas(settings)
    assert set(recorded["tills/Opened/2"]["properties"]) == {"first", "last"}

    # An operator's tombstone forgets a record that stands for no stored event
    producer = AIOKafkaProducer(**client_options(settings), acks="all")
    await producer.start()
    try:
        await producer.send_and_wait(TopicNames(settings.app).schemas, None, key=b"tills/Opened/2")
    finally:
        await producer.stop()
    await hold_to_recorded_schemas(settings, HOTFIX, refuse=True)
    assert set((await recorded_schemas(settings))["tills/Opened/2"]["properties"]) == {"owner", "currency"}


SHOP = """
    from esk import AggregateType, Command, Event
    from pydantic import BaseModel

    class Open(Command):
        owner: str

    class Opened(Event):
        schema_version = 2
        owner: str
        currency: str

    class Till(BaseModel):
        owner: str

    tills = AggregateType(
        name="tills", state=Till, commands={"open": Open}, creates=frozenset({Open}), events=[Opened],
        decide=lambda state, command: [], evolve=lambda state, event: state,
        upcasters={("Opened", 1): lambda data: {**data, "currency": "EUR"}},
    )
    AGGREGATES = [tills]
"""


def _shop(settings: Settings, tmp_path: Path) -> dict[str, str]:
    """The hotfix's project in `tmp_path`; the environment its esk commands run in."""
    (tmp_path / "shop.py").write_text(textwrap.dedent(SHOP), encoding="utf-8")
    return {k: v for k, v in os.environ.items() if not k.startswith(("ESK_", "_ESK_"))} | {
        "ESK_DOMAIN": "shop:AGGREGATES", "ESK_APP": settings.app, "ESK_KAFKA__BOOTSTRAP_SERVERS": settings.bootstrap_servers,
        "ESK_PROCESSOR__METRICS_PORT": "0", "ESK_PROCESSOR__STATE_DIR": str(tmp_path / "state"),
    }  # fmt: skip


async def _esk(tmp_path: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "esk", *args], cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env,
    )


async def test_esk_processor_refuses_to_start_on_code_that_contradicts_them_with_no_lock_file(settings: Settings, tmp_path: Path) -> None:
    """No lock file beside it (a COPY forgotten, or a hotfix's): the brokers still tell."""
    await ensure_topics(settings, topic_specs(settings, ["tills"]))
    await hold_to_recorded_schemas(settings, RELEASE_2, refuse=True)
    processor = await _esk(tmp_path, _shop(settings, tmp_path), "processor")
    assert processor.returncode == 1, processor.stderr
    assert "tills event Opened v2: new required field `owner`, against the v2 events stored" in processor.stderr
    assert processor.stderr.strip().splitlines()[-1].startswith(
        f"error: {settings.app}.schemas: this code would write events of another shape under schema versions stored already"
    ), processor.stderr
    assert await records(settings) == 1  # nothing recorded of it


async def test_a_hotfix_checked_with_recorded_is_told_what_the_rolled_back_release_stored(settings: Settings, tmp_path: Path) -> None:
    """The lock a rollback took back is release 1's, which never saw release 2's v2: the
    hotfix's v2 of another shape passes it, and the brokers' record tells it."""
    await ensure_topics(settings, topic_specs(settings, ["tills"]))
    await hold_to_recorded_schemas(settings, RELEASE_2, refuse=True)
    env = _shop(settings, tmp_path)
    write_lock(build_lock(RELEASE_1), tmp_path / "esk.lock.json")
    assert (checked := await _esk(tmp_path, env, "schema", "check")).returncode == 0, checked.stderr
    checked = await _esk(tmp_path, env, "schema", "check", "--recorded")
    assert checked.returncode == 1, checked.stdout + checked.stderr
    assert "tills event Opened v2: new required field `owner`, against the v2 events stored" in checked.stdout
    assert "they break the events stored under it" in checked.stderr
