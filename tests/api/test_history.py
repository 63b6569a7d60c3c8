"""An aggregate's history (`GET /v1/{type}/{id}/events`) from the history index every API
instance keeps of the events topics: no batch job, the user's own domain, read-your-writes.

The key order, what a fetch writes and the waiting of a read are pure logic, tested without
Kafka; the rest runs one system (broker, processor, API) for the module, over a small
domain of a user's own (`counters`, with an upcaster) and no read models at all."""

from __future__ import annotations

import asyncio
import logging
import struct
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiokafka import AIOKafkaProducer, TopicPartition
from aiokafka.structs import ConsumerRecord
from prometheus_client.parser import text_string_to_metric_families

from esk.api.history import EventHistory, offset_key
from esk.api.problems import Problem
from esk.api.read_after import ReadAfter
from esk.broker import EmbeddedBroker
from esk.kafka.client_options import client_options
from esk.projections.catalog import Projection
from esk.projections.positions import Position, Positions
from esk.protocol import EventRecord, aggregate_key, history_key, history_prefix, prefix_end
from esk.settings import Settings
from esk.state.resources import StoreResources
from esk.state.store import RocksDBStore
from tests.conftest import own_settings
from tests.counters import AGGREGATES, counters  # noqa: F401 - AGGREGATES: the domain setting names it here
from tests.system import System, api_app, events_topic, read_topic, system, wait_for, with_state_dirs

# -- the user's domain (tests/counters.py) and no read models ---------------------------

READ_MODELS: list[Projection] = []

# -- pure logic ----------------------------------------------------------------------


def test_an_aggregates_keys_sort_by_version_and_hold_no_other_aggregates() -> None:
    versions = [10, 2, 1, 256, 9, 11, 65_536]
    keys = [history_key("counters", "c1", v) for v in versions]
    assert sorted(keys) == [history_key("counters", "c1", v) for v in sorted(versions)]
    prefix = history_prefix("counters", "c1")
    assert all(prefix <= key < prefix_end(prefix) for key in keys)
    others = [history_key("counters", "c10", 1), history_key("counters", "c", 1), history_key("counter", "c1", 1)]
    assert not any(prefix <= key < prefix_end(prefix) for key in [*others, aggregate_key("counters", "c1")])


TOPIC = "shop.counters.events"
TP = TopicPartition(TOPIC, 0)


def event(aggregate_id: str, version: int, type_name: str = "Added", data: dict[str, Any] | None = None, schema_version: int = 2) -> bytes:
    """An event record as the processor writes it (an Added adds its version, by default)."""
    if data is None:
        data = {"n": version} if type_name == "Added" else {}
    return EventRecord(
        f"counters/{aggregate_id}/{version}/{uuid.uuid4().hex[:6]}", "counters", aggregate_id, version, type_name,
        schema_version, data, "cmd", "corr", "cmd", 1_700_000_000_000 + version,
    ).encode()


def fetched(*values: bytes, offset: int = 0) -> dict[TopicPartition, list[ConsumerRecord[bytes, bytes]]]:
    return {TP: [
        ConsumerRecord(
            topic=TOPIC, partition=0, offset=offset + n, timestamp=0, timestamp_type=0, key=b"", value=value,
            checksum=None, serialized_key_size=0, serialized_value_size=0, headers=[],
        )
        for n, value in enumerate(values)
    ]}


@pytest.fixture
def index(tmp_path: Path) -> Iterator[EventHistory]:
    history = EventHistory(Settings(app="shop", api={"state_dir": tmp_path}, _env_file=None), {"counters": counters})
    history.store = RocksDBStore(history.path, StoreResources(16))
    yield history
    history.store.close()


def test_a_fetch_is_indexed_with_its_offsets_and_an_aggregate_created_anew_starts_over(index: EventHistory) -> None:
    store = index.store
    assert store is not None
    index.write(store, fetched(event("c1", 1, "Started"), event("c1", 2), b"not an event", event("c1", 3)), {TP: 4})
    assert [e["version"] for e in index.events("counters", "c1").events] == [1, 2, 3]
    assert index.stored_offsets(store) == {TP: 4}

    # c1 expired and was created again: its topic holds a second history from version 1,
    # which replaces the first, in the store and within one fetch alike.
    again = [event("c1", 1, "Started"), event("c1", 2), event("c2", 1, "Started"), event("c2", 2), event("c2", 1, "Started")]
    index.write(store, fetched(*again, offset=4), {TP: 9})
    assert [(e["version"], e["event_id"]) for e in index.events("counters", "c1").events] == [
        (v, EventRecord.decode(again[n]).event_id) for n, v in ((0, 1), (1, 2))
    ]
    assert [(e["version"], e["event_id"]) for e in index.events("counters", "c2").events] == [(1, EventRecord.decode(again[4]).event_id)]
    assert index.stored_offsets(store) == {TP: 9}
    assert index.events("counters", "c3").events == []


def test_events_are_shown_in_their_types_current_schema(index: EventHistory) -> None:
    assert index.store is not None
    legacy = [
        event("old", 1, "Started", schema_version=1),
        event("old", 2, data={"amount": 7}, schema_version=1),
        event("old", 3, "Renamed", {"to": "x"}, schema_version=1),  # no longer a type of the domain
        # upcast to {"n": "8"}: shown as the processor reads it, the event class's 8
        event("old", 4, data={"amount": "8"}, schema_version=1),
    ]
    index.write(index.store, fetched(*legacy), {TP: 4})
    shown = index.events("counters", "old").events
    assert [(e["type"], e["schema_version"], e["data"]) for e in shown] == [
        ("Started", 1, {}), ("Added", 2, {"n": 7}), ("Renamed", 1, {"to": "x"}), ("Added", 2, {"n": 8}),
    ]
    assert set(shown[0]) == {"event_id", "type", "version", "schema_version", "recorded_at", "command_id", "data"}


def test_a_history_is_read_a_page_at_a_time(index: EventHistory) -> None:
    assert index.store is not None
    index.write(index.store, fetched(*[event("long", v, "Started" if v == 1 else "Added") for v in range(1, 12)], event("long2", 1, "Started")), {TP: 12})
    pages, start = [], 1
    while True:
        page = index.events("counters", "long", start, 4)
        pages.append([e["version"] for e in page.events])
        if page.next_version is None:
            break
        start = page.next_version
    assert pages == [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11]]
    assert index.events("counters", "long", 9, 3) == index.events("counters", "long", 9)  # a full last page has no next
    assert index.events("counters", "long", 9, 3).next_version is None
    assert index.events("counters", "long", 12).events == []  # past the end; long2 is another aggregate


def test_a_reads_after_and_wait() -> None:
    token = f"{TOPIC}/0/5"
    assert ReadAfter.of([], None, 30).wait_s == 0
    assert ReadAfter.of([token], None, 30) == ReadAfter([Position(TOPIC, 0, 5)], 5.0)
    assert ReadAfter.of([token], 60_000, 30).wait_s == 30
    for tokens, wait_ms, code in (
        ([token], -1, "invalid_wait"),
        (["nonsense"], None, "invalid_position"),
        ([f"{TOPIC}/0/{2**80}"], None, "invalid_position"),  # no Kafka offset is that far
        ([f"{TOPIC}/{2**31}/1"], None, "invalid_position"),
    ):
        with pytest.raises(Problem) as refused:
            ReadAfter.of(tokens, wait_ms, 30)
        assert refused.value.status == 400 and refused.value.code == code
    ReadAfter.of([token], None, 30).check_topics("it", {TOPIC})
    with pytest.raises(Problem) as foreign:  # never reached, so never waited for
        ReadAfter.of([token, "other/0/1"], None, 30).check_topics("it", {TOPIC})
    assert foreign.value.code == "invalid_position" and "other/0/1" in foreign.value.detail


async def test_a_waiting_read_answers_when_told_of_a_move_and_gives_up_at_its_bound() -> None:
    positions: Positions = {(TOPIC, 0): 3}
    moves: list[asyncio.Future[None]] = []

    async def current() -> Positions:
        return dict(positions)

    def moved() -> asyncio.Future[None]:
        moves.append(asyncio.get_running_loop().create_future())
        return moves[-1]

    loop = asyncio.get_running_loop()
    waiting = asyncio.create_task(ReadAfter([Position(TOPIC, 0, 5)], 10.0).reflected("it", current, moved))
    await asyncio.sleep(0.05)
    positions[TOPIC, 0] = 5
    moves[-1].set_result(None)
    started = loop.time()
    assert await waiting == {(TOPIC, 0): 5}
    assert loop.time() - started < 0.05  # woken, not polled
    assert all(move.done() for move in moves)  # none left behind

    started = loop.time()
    with pytest.raises(Problem) as late:
        await ReadAfter([Position(TOPIC, 0, 9)], 0.2).reflected("it", current)
    assert late.value.status == 503 and late.value.code == "not_caught_up"
    assert late.value.extra["positions"] == [{"topic": TOPIC, "partition": 0, "offset": 5, "token": f"{TOPIC}/0/5"}]
    assert 0.2 <= loop.time() - started < 5  # at its limit, not at some later poll


# -- against the broker --------------------------------------------------------------


@pytest.fixture(scope="module")
async def shop(broker: EmbeddedBroker, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[System]:
    settings = own_settings(broker, tmp_path_factory.mktemp("history")).model_copy(
        update={"domain": f"{__name__}:AGGREGATES", "read_models": f"{__name__}:READ_MODELS"}
    )
    async with system(settings) as s:
        await wait_for(s.apps[0].state.history.ready.is_set, what="history index caught up")
        yield s


def new_id() -> str:
    return uuid.uuid4().hex[:12]


async def count_to(s: System, counter: str, adds: int) -> str:
    """Start a counter and add 1..adds to it; the last answer's position token."""
    r = await s.client.post(f"/v1/counters/{counter}/start", json={})
    assert r.status_code == 200, r.text
    for n in range(1, adds + 1):
        r = await s.client.post(f"/v1/counters/{counter}/add", json={"n": n})
        assert r.status_code == 200, r.text
    token: str = r.json()["position"]["token"]
    return token


@pytest.mark.kafka
async def test_a_commands_events_show_at_once_in_version_order(shop: System) -> None:
    counter = new_id()
    token = await count_to(shop, counter, 11)
    r = await shop.client.get(f"/v1/counters/{counter}/events", params={"after": token})
    assert r.status_code == 200, r.text
    body = r.json()
    assert (body["type"], body["id"]) == ("counters", counter)
    assert [(e["version"], e["type"], e["data"]) for e in body["events"]] == [(1, "Started", {})] + [
        (n + 1, "Added", {"n": n}) for n in range(1, 12)
    ]
    on_topic = [v for k, v, _ in await read_topic(shop.settings, events_topic(shop.settings, "counters")) if k == counter.encode()]
    fields = ("event_id", "type", "version", "schema_version", "recorded_at", "command_id", "data")
    assert body["events"] == [{f: e[f] for f in fields} for e in on_topic]
    position = Position.parse(token)
    reached = {(p["topic"], p["partition"]): p["offset"] for p in body["positions"]}
    assert reached[position.topic, position.partition] >= position.offset
    assert body["next_version"] is None
    # /metrics says how far the index is in every partition, those without events too
    topic = events_topic(shop.settings, "counters")
    metrics = (await shop.client.get("/metrics")).text
    shown = {
        int(sample.labels["partition"]): sample.value
        for family in text_string_to_metric_families(metrics)
        for sample in family.samples
        if sample.name == "esk_history_position" and sample.labels["topic"] == topic
    }
    assert sorted(shown) == list(range(shop.settings.topics.partitions)), metrics
    assert shown[position.partition] >= position.offset

    # A page at a time: the next one starts where the answer says; past the end, none.
    r = await shop.client.get(f"/v1/counters/{counter}/events", params={"from_version": 3, "limit": 5})
    assert [e["version"] for e in r.json()["events"]] == [3, 4, 5, 6, 7] and r.json()["next_version"] == 8
    r = await shop.client.get(f"/v1/counters/{counter}/events", params={"from_version": 8, "limit": 5})
    assert [e["version"] for e in r.json()["events"]] == [8, 9, 10, 11, 12] and r.json()["next_version"] is None
    r = await shop.client.get(f"/v1/counters/{counter}/events", params={"from_version": 13})
    assert r.status_code == 200 and r.json()["events"] == []
    refused = (
        ({"from_version": 0}, "invalid_from_version"), ({"from_version": 2**63}, "invalid_from_version"),
        ({"limit": 0}, "invalid_limit"), ({"limit": 1001}, "invalid_limit"),
    )
    for params, code in refused:
        r = await shop.client.get(f"/v1/counters/{counter}/events", params=params)
        assert r.status_code == 400 and r.json()["code"] == code, r.text

    r = await shop.client.get(f"/v1/counters/{new_id()}/events", params={"from_version": 2})
    assert r.status_code == 404 and r.json()["code"] == "not_found"
    r = await shop.client.get(f"/v1/counters/{new_id()}/events")
    assert r.status_code == 404 and r.json()["code"] == "not_found"
    r = await shop.client.get(f"/v1/nope/{counter}/events")
    assert r.status_code == 404 and r.json()["code"] == "unknown_aggregate_type"


@pytest.mark.kafka
async def test_a_read_after_a_position_waits_for_the_index_and_says_when_it_did_not(shop: System) -> None:
    counter = new_id()
    token = await count_to(shop, counter, 1)
    position = Position.parse(token)
    url = f"/v1/counters/{counter}/events"

    r = await shop.client.get(url, params={"after": f"{position.topic}/{position.partition}/{10**12}", "wait_ms": 200})
    assert r.status_code == 503 and r.json()["code"] == "not_caught_up", r.text
    assert r.headers["retry-after"] == "1" and r.json()["positions"]

    # A read waiting for what the next command writes answers once the index has it.
    r = await shop.client.get(url, params={"after": token})
    reached = {(p["topic"], p["partition"]): p["offset"] for p in r.json()["positions"]}
    following = f"{position.topic}/{position.partition}/{reached[position.topic, position.partition] + 1}"
    waiting = asyncio.create_task(shop.client.get(url, params={"after": following, "wait_ms": 20_000}))
    await asyncio.sleep(0.3)
    assert not waiting.done()
    added = await shop.client.post(f"/v1/counters/{counter}/add", json={"n": 5})
    r = await asyncio.wait_for(waiting, 10)
    assert r.status_code == 200, r.text
    assert [e["version"] for e in r.json()["events"]] == [1, 2, 3] == list(range(1, added.json()["version"] + 1))

    for after in (f"{shop.settings.app}.changelog/0/1", "t-other.counters.events/0/1", "nonsense"):
        r = await shop.client.get(url, params={"after": after})
        assert r.status_code == 400 and r.json()["code"] == "invalid_position", (after, r.text)
    # a partition the topic does not have would never be reached: told, not waited for
    partitions = shop.settings.topics.partitions
    r = await shop.client.get(url, params={"after": f"{position.topic}/{partitions}/1", "wait_ms": 20_000})
    assert r.status_code == 400 and r.json()["code"] == "invalid_position", r.text
    assert r.json()["detail"] == f"{position.topic}/{partitions}/1: {position.topic} has partitions 0 to {partitions - 1}"
    r = await shop.client.get(url, params={"after": token, "wait_ms": -1})
    assert r.status_code == 400 and r.json()["code"] == "invalid_wait"


@pytest.mark.kafka
async def test_old_schema_versions_are_upcast_and_aborted_events_never_show(shop: System) -> None:
    topic = events_topic(shop.settings, "counters")
    legacy, ghost = new_id(), new_id()

    def written(aggregate_id: str, version: int, type_name: str, data: dict[str, Any]) -> bytes:
        return orjson.dumps({
            "event_id": f"counters/{aggregate_id}/{version}", "aggregate_type": "counters", "aggregate_id": aggregate_id,
            "version": version, "type": type_name, "schema_version": 1, "data": data, "command_id": "x",
            "correlation_id": "x", "causation_id": "x", "recorded_at": 1_700_000_000_000,
        })

    producer = AIOKafkaProducer(**client_options(shop.settings), transactional_id=f"legacy-{uuid.uuid4()}")
    await producer.start()
    try:
        await producer.begin_transaction()
        aborted = await producer.send_and_wait(topic, written(ghost, 1, "Started", {}), key=ghost.encode())
        await producer.abort_transaction()
        async with producer.transaction():  # written by an older release: Added v1 said "amount"
            await producer.send_and_wait(topic, written(legacy, 1, "Started", {}), key=legacy.encode())
            last = await producer.send_and_wait(topic, written(legacy, 2, "Added", {"amount": 7}), key=legacy.encode())
    finally:
        await producer.stop()

    after = [f"{topic}/{last.partition}/{last.offset + 1}", f"{topic}/{aborted.partition}/{aborted.offset + 1}"]
    r = await shop.client.get(f"/v1/counters/{legacy}/events", params={"after": after})
    assert r.status_code == 200, r.text
    assert [(e["type"], e["schema_version"], e["data"]) for e in r.json()["events"]] == [("Started", 1, {}), ("Added", 2, {"n": 7})]
    r = await shop.client.get(f"/v1/counters/{ghost}/events", params={"after": after})
    assert r.status_code == 404 and r.json()["code"] == "not_found", r.text


@pytest.mark.kafka
async def test_a_restarted_api_resumes_its_index(shop: System, caplog: pytest.LogCaptureFixture) -> None:
    counter = new_id()
    await count_to(shop, counter, 2)
    own = with_state_dirs(shop.settings, "restarted")
    async with api_app(own, shop.registry) as (app, client):
        await wait_for(app.state.history.ready.is_set, what="history index caught up")
        before = (await client.get(f"/v1/counters/{counter}/events")).json()["events"]
        assert [e["version"] for e in before] == [1, 2, 3]

        # While the index has not caught up since the start (made to look so here), reads
        # are refused rather than answered from part of the history.
        app.state.history.ready.clear()
        r = await client.get(f"/v1/counters/{counter}/events")
        assert r.status_code == 503 and r.json()["code"] == "history_catching_up", r.text
        assert r.headers["retry-after"] == "1" and r.json()["positions"]
        # A read that may wait waits for the catch-up too, and reads once it is over.
        asyncio.get_running_loop().call_later(0.5, app.state.history.ready.set)
        r = await client.get(f"/v1/counters/{counter}/events", params={"wait_ms": 5000})
        assert r.status_code == 200 and [e["version"] for e in r.json()["events"]] == [1, 2, 3], r.text

    token = (await shop.client.post(f"/v1/counters/{counter}/add", json={"n": 9})).json()["position"]["token"]
    caplog.set_level(logging.INFO, logger="esk.api.follower")
    caplog.clear()
    async with api_app(own, shop.registry) as (app, client):
        await wait_for(app.state.history.ready.is_set, what="history index caught up")
        r = await client.get(f"/v1/counters/{counter}/events", params={"after": token})
        assert r.status_code == 200, r.text
        assert r.json()["events"][:3] == before
        assert [e["version"] for e in r.json()["events"]] == [1, 2, 3, 4]
    # It read only what was written while it was down: the event of that one command.
    [caught_up] = [m for m in caplog.messages if m.startswith("the API's history caught up")]
    assert caught_up.startswith("the API's history caught up (1 records"), caught_up

    # An index that claims offsets its topics never had (the topics were recreated) is
    # rebuilt from their beginning, not trusted.
    index = EventHistory(own, shop.registry)
    store = RocksDBStore(index.path, StoreResources(16))
    store.write({offset_key(TopicPartition(events_topic(own, "counters"), 0)): struct.pack(">q", 10**9)}, {})
    store.close()
    caplog.clear()
    async with api_app(own, shop.registry) as (app, client):
        await wait_for(app.state.history.ready.is_set, what="history index rebuilt")
        r = await client.get(f"/v1/counters/{counter}/events")
        assert [e["version"] for e in r.json()["events"]] == [1, 2, 3, 4]
    assert any("history is beyond the end" in m for m in caplog.messages), caplog.messages


@pytest.mark.kafka
async def test_an_api_without_the_history_index_says_so(shop: System) -> None:
    counter = new_id()
    await count_to(shop, counter, 0)
    own = with_state_dirs(shop.settings, "no-history")
    own = own.model_copy(update={"api": own.api.model_copy(update={"history": False})})
    async with api_app(own, shop.registry) as (app, client):
        assert app.state.history is None
        assert (await client.get(f"/v1/counters/{counter}", params={"min_version": 1})).status_code == 200
        r = await client.get(f"/v1/counters/{counter}/events")
        assert r.status_code == 404 and r.json()["code"] == "history_disabled", r.text
    assert not (Path(own.api.state_dir) / f"{own.app}.history").exists()
