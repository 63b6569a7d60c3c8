"""G9: a changed state model never makes an existing aggregate unusable. Tried as a new
user would: run esk with a state model, create aggregates, stop, change the model (rename
a field, add a required one that `evolve` fills in), start again."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from aiokafka.structs import ConsumerRecord
from pydantic import BaseModel
from typer.testing import CliRunner

from esk import AggregateType, Command, Decision, Event
from esk.cli import cli
from esk.kafka.topics import ensure_topics, topic_specs
from esk.metrics import REBUILT_AGGREGATES
from esk.processing.state_rebuild import _Fold, _fold_records, unusable_aggregates
from esk.protocol import STATE_UNUSABLE, EventRecord, StoredAggregate
from esk.registry import Registry
from esk.settings import Settings
from tests.system import api, processor, wait_for, with_state_dirs

pytestmark = pytest.mark.kafka


class Start(Command):
    pass


class Add(Command):
    n: int


class Started(Event):
    pass


class Added(Event):
    n: int


class CounterV1(BaseModel):
    count: int


class CounterV2(BaseModel):  # the next release: `count` is `total` now, and `adds` is new
    total: int
    adds: int


def _decide(_state: BaseModel | None, command: Command) -> Decision:
    return [Added(n=command.n)] if isinstance(command, Add) else [Started()]


def _counters(
    state: type[BaseModel], evolve: Callable[[Any, Event], BaseModel], events: list[type[Event]] | None = None, state_version: int = 1
) -> Registry:
    counters: AggregateType[Any] = AggregateType(
        name="counters", state=state, commands={"start": Start, "add": Add}, creates=frozenset({Start}),
        events=events or [Started, Added], decide=_decide, evolve=evolve, state_version=state_version,
    )
    return {"counters": counters}


def _v1(state: CounterV1 | None, event: Event) -> CounterV1:
    return CounterV1(count=(state.count if state else 0) + (event.n if isinstance(event, Added) else 0))


def _v2(state: CounterV2 | None, event: Event) -> CounterV2:
    if not isinstance(event, Added):
        return CounterV2(total=0, adds=0)
    assert state is not None
    return CounterV2(total=state.total + event.n, adds=state.adds + 1)


def _v2_that_fails_on_13(state: CounterV2 | None, event: Event) -> CounterV2:
    if isinstance(event, Added) and event.n == 13:
        raise ValueError("13 is unlucky")
    return _v2(state, event)


async def _make(client: httpx.AsyncClient, counter: str, *amounts: int) -> None:
    assert (await client.post(f"/v1/counters/{counter}/start", json={})).status_code == 200
    for n in amounts:
        assert (await client.post(f"/v1/counters/{counter}/add", json={"n": n})).status_code == 200


async def test_states_of_a_changed_model_are_rebuilt_from_their_events(settings: Settings) -> None:
    v1, v2 = _counters(CounterV1, _v1), _counters(CounterV2, _v2)
    await ensure_topics(settings, topic_specs(settings, v1))
    own, api_settings = with_state_dirs(settings, "p0"), with_state_dirs(settings, "a0")
    ids = [f"c{n}" for n in range(6)]
    async with api(api_settings, v1) as client:
        async with processor(own, v1):
            for counter in ids:
                await _make(client, counter, 2, 3)
            assert (await client.get("/v1/counters/c0")).json()["state"] == {"count": 5}

    rebuilt_before = REBUILT_AGGREGATES._value.get()
    async with api(api_settings, v2) as client:
        async with processor(own, v2) as running:  # ready only once the states are rebuilt
            assert REBUILT_AGGREGATES._value.get() - rebuilt_before == len(ids)
            assert running.processor.restores  # the store was intact: nothing restored beyond it

            async def served_rebuilt() -> bool:  # the API's replica reads the rebuilt record after the processor is ready
                return bool((await client.get("/v1/counters/c0")).json()["state"] == {"total": 5, "adds": 2})

            await wait_for(served_rebuilt, 30, "the API to serve c0's rebuilt state")
            r = await client.post("/v1/counters/c0/add", json={"n": 1})
            assert r.status_code == 200 and r.json()["version"] == 4
            assert (await client.get("/v1/counters/c0?min_version=4")).json()["state"] == {"total": 6, "adds": 3}

        # A start with the same model rebuilds nothing again.
        async with processor(own, v2):
            assert REBUILT_AGGREGATES._value.get() - rebuilt_before == len(ids)


def _v1_with_a_bonus(state: CounterV1 | None, event: Event) -> CounterV1:
    """The same model, another rule: each add counts one more."""
    return CounterV1(count=(state.count if state else 0) + (event.n + 1 if isinstance(event, Added) else 0))


async def test_a_changed_evolve_rebuilds_the_states_once_its_state_version_is_raised(settings: Settings) -> None:
    """The model as it was, `evolve` changed: nothing in the code tells the stored states
    are another rule's. Raising `state_version` says so, and they are rebuilt."""
    await ensure_topics(settings, topic_specs(settings, _counters(CounterV1, _v1)))
    own, api_settings = with_state_dirs(settings, "p0"), with_state_dirs(settings, "a0")
    async with api(api_settings, _counters(CounterV1, _v1)) as client:
        async with processor(own, _counters(CounterV1, _v1)):
            await _make(client, "c0", 2, 3)
    for state_version, count in ((1, 5), (2, 7)):  # the new rule unseen, then rebuilt
        registry = _counters(CounterV1, _v1_with_a_bonus, state_version=state_version)
        async with api(api_settings, registry) as client, processor(own, registry):
            assert (await client.get("/v1/counters/c0")).json()["state"] == {"count": count}
    with pytest.raises(ValueError, match="state_version starts at 1, not 0"):
        _counters(CounterV1, _v1, state_version=0)


async def test_an_aggregate_whose_events_do_not_fold_is_unusable_and_the_others_go_on(settings: Settings) -> None:
    v1, broken = _counters(CounterV1, _v1), _counters(CounterV2, _v2_that_fails_on_13)
    await ensure_topics(settings, topic_specs(settings, v1))
    own, api_settings = with_state_dirs(settings, "p0"), with_state_dirs(settings, "a0")
    async with api(api_settings, v1) as client:
        async with processor(own, v1):
            await _make(client, "good", 1)
            await _make(client, "bad", 13)

    async with api(api_settings, broken) as client:
        async with processor(own, broken):
            r = await client.post("/v1/counters/bad/add", json={"n": 1}, headers={"Idempotency-Key": "bad-2"})
            outcome = (await client.get("/v1/commands/bad-2")).json()
            assert outcome["code"] == STATE_UNUSABLE
            assert outcome["detail"].startswith("counters 'bad' cannot be used: evolve failed on its Added v1 event at ")
            assert outcome["detail"].endswith(": ValueError: 13 is unlucky"), outcome["detail"]
            assert r.status_code == 500 and r.json()["code"] == STATE_UNUSABLE
            r = await client.post("/v1/counters/good/add", json={"n": 1})
            assert r.status_code == 200 and r.json()["version"] == 3
            # a read shows the state it had, and says why its commands are refused
            read = (await client.get("/v1/counters/bad")).json()
            assert read["state"] == {"count": 13} and read["unusable"].endswith("ValueError: 13 is unlucky")
            assert (await client.get("/v1/counters/good")).json()["unusable"] is None
            listed = await unusable_aggregates(settings)
            assert list(listed) == [("counters", "bad")] and "13 is unlucky" in listed["counters", "bad"]
            told = await asyncio.to_thread(CliRunner().invoke, cli, ["state", "unusable"], env=_cli_env(settings))
            assert told.exit_code == 1 and told.output.startswith("counters/bad: evolve failed on its Added v1 event at "), told.output

    # The fixed code's next start rebuilds it.
    fixed = _counters(CounterV2, _v2)
    async with api(api_settings, fixed) as client:
        async with processor(own, fixed):
            r = await client.post("/v1/counters/bad/add", json={"n": 1})
            assert r.status_code == 200 and r.json()["version"] == 3
            assert (await client.get("/v1/counters/bad?min_version=3")).json()["state"] == {"total": 14, "adds": 2}
            assert await unusable_aggregates(settings) == {}
            told = await asyncio.to_thread(CliRunner().invoke, cli, ["state", "unusable"], env=_cli_env(settings))
            assert (told.exit_code, told.output) == (0, "no unusable aggregates\n"), told.output


def _cli_env(settings: Settings) -> dict[str, str]:
    return {"ESK_APP": settings.app, "ESK_KAFKA__BOOTSTRAP_SERVERS": settings.bootstrap_servers, "COLUMNS": "250"}


# -- why an aggregate is unusable, in one line (pure: records as the topic holds them) ------


def _added_with_unit() -> type[Event]:
    class Added(Event):  # the next release's, changed under its schema_version: `unit` is new and required
        n: int
        unit: str

    return Added


def _records(*events: tuple[str, int, dict[str, Any]]) -> list[ConsumerRecord[bytes, bytes]]:
    return [
        ConsumerRecord(
            topic="shop.counters.events", partition=0, offset=offset, timestamp=0, timestamp_type=0, key=b"c1",
            value=EventRecord(f"e{offset}", "counters", "c1", offset + 1, name, schema_version, data, "c", "c", "c", 1).encode(),
            checksum=None, serialized_key_size=0, serialized_value_size=0, headers=[],
        )
        for offset, (name, schema_version, data) in enumerate(events)
    ]


def _reason(
    events: list[type[Event]], *records: tuple[str, int, dict[str, Any]], upcasters: dict[tuple[str, int], Any] | None = None
) -> str | None:
    registry = _counters(CounterV2, _v2, events)
    if upcasters:
        registry["counters"] = dataclasses.replace(registry["counters"], upcasters=upcasters)
    fold = _Fold(StoredAggregate(version=len(records), state={}, updated_at=0))
    _fold_records(registry, "counters", {"c1": fold}, _records(*records))
    return fold.error


def test_an_event_that_does_not_fit_its_model_is_told_in_one_line_with_what_to_do() -> None:
    reason = _reason([Started, _added_with_unit()], ("Started", 1, {}), ("Added", 1, {"n": 2}))
    assert reason == (
        "its Added v1 event at shop.counters.events/0/1 does not fit the event as the code has it (unit: Field required): "
        "a changed event needs a new schema_version and an upcaster (esk schema check)"
    )


def test_an_event_of_a_newer_version_than_the_code_is_told_so() -> None:
    reason = _reason([Started, Added], ("Started", 1, {}), ("Added", 2, {"n": 2, "unit": "kg"}))
    assert reason == (
        "its Added v2 event at shop.counters.events/0/1: NewerSchemaVersion: counters event Added v2 is newer than this "
        "code's v1: written by newer code (run that code, or add the version here)"
    )


def test_an_upcaster_that_fails_is_told_as_its_own_failure() -> None:
    class Added(Event):  # v2: `n` became `amount`
        schema_version = 2
        amount: int

    def upcast(data: dict[str, Any]) -> dict[str, Any]:
        return Added.model_validate({"amount": f"{data['n']} kg"}).model_dump()  # a bug that pydantic reports

    reason = _reason([Started, Added], ("Started", 1, {}), ("Added", 1, {"n": 2}), upcasters={("Added", 1): upcast})
    # the upcaster's own failure, not the advice for an event changed under its version
    assert reason is not None and reason.startswith("its Added v1 event at shop.counters.events/0/1: amount: Input should be"), reason
    assert "needs a new schema_version" not in reason
