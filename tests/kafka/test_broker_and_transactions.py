"""The embedded broker is a real Kafka: transactions, topic configs, restarts."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.errors import KafkaError, TopicAuthorizationFailedError, UnknownTopicOrPartitionError
from typer.testing import CliRunner

from esk import cli as esk_cli
from esk.broker import BrokerError, EmbeddedBroker
from esk.broker.embedded import BrokerNode, port_is_free
from esk.broker.ports import _server_ranges, free_port, free_port_pair
from esk.kafka.client_options import client_options
from esk.kafka.reader import group_member
from esk.kafka.topics import TopicNames, coordinators_ready, ensure_topics, topic_configs, topic_specs
from esk.registry import load_registry
from esk.settings import BrokerSettings, Settings
from tests.system import wait_for

pytestmark = pytest.mark.kafka


async def test_read_committed_never_sees_an_aborted_record(settings: Settings) -> None:
    await ensure_topics(settings, topic_specs(settings, ["accounts"]))
    topic = TopicNames(settings.app).commands
    producer = AIOKafkaProducer(
        bootstrap_servers=settings.bootstrap_servers, transactional_id=f"tx-{uuid.uuid4()}"
    )
    await producer.start()
    try:
        async with producer.transaction():
            await producer.send_and_wait(topic, b"committed-1", key=b"k", partition=0)
        await producer.begin_transaction()
        await producer.send_and_wait(topic, b"aborted", key=b"k", partition=0)
        await producer.abort_transaction()
        async with producer.transaction():
            await producer.send_and_wait(topic, b"committed-2", key=b"k", partition=0)
    finally:
        await producer.stop()

    # The coordinator answers a commit before the partition has its marker (a few ms later),
    # and read_committed reads up to the marker only: the last commit's may lag the answer.
    await wait_for(lambda: _committed_ends_with(settings, topic, b"committed-2"), timeout_s=10, what="the last commit's marker")
    seen_committed = await _read_all(settings, topic, "read_committed")
    seen_uncommitted = await _read_all(settings, topic, "read_uncommitted")
    assert seen_committed == [b"committed-1", b"committed-2"]
    assert b"aborted" in seen_uncommitted  # the record is in the log; only the isolation hides it


async def _committed_ends_with(settings: Settings, topic: str, value: bytes) -> bool:
    return (await _read_all(settings, topic, "read_committed"))[-1:] == [value]


async def _read_all(settings: Settings, topic: str, isolation: str) -> list[bytes]:
    consumer = AIOKafkaConsumer(
        bootstrap_servers=settings.bootstrap_servers, isolation_level=isolation, enable_auto_commit=False
    )
    await consumer.start()
    try:
        tp = TopicPartition(topic, 0)
        consumer.assign([tp])
        await consumer.seek_to_beginning(tp)
        end = (await consumer.end_offsets([tp]))[tp]
        values: list[bytes] = []
        while await consumer.position(tp) < end:
            batch = await consumer.getmany(tp, timeout_ms=1000)
            values.extend(r.value for r in batch.get(tp, []))
        return values
    finally:
        await consumer.stop()


async def test_topics_are_created_as_specified_and_init_is_idempotent(settings: Settings) -> None:
    specs = topic_specs(settings, ["accounts", "orders"])
    first = await ensure_topics(settings, specs)
    assert sorted(first.created) == sorted(s.name for s in specs) and not first.problems
    second = await ensure_topics(settings, specs)
    assert second.created == [] and second.problems == [] and sorted(second.ok) == sorted(first.created)

    names = TopicNames(settings.app)
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.bootstrap_servers)
    await admin.start()
    try:
        configs = await topic_configs(admin, [names.changelog, names.events("orders")])
        described = {d["topic"]: d for d in await admin.describe_topics([names.changelog])}
        # a broker that does not know a topic (yet) says so for that topic alone: raised, so
        # ensure_topics asks again rather than report a topic without its configs
        with pytest.raises(UnknownTopicOrPartitionError):
            await topic_configs(admin, [names.changelog, names.events("nobody")])
    finally:
        await admin.close()
    assert configs[names.changelog]["cleanup.policy"] == "compact"
    assert configs[names.events("orders")]["retention.ms"] == "-1"
    assert configs[names.changelog]["min.insync.replicas"] == "1"
    assert len(described[names.changelog]["partitions"]) == settings.topics.partitions


async def test_a_wrong_partition_count_or_policy_is_reported(settings: Settings) -> None:
    await ensure_topics(settings, topic_specs(settings, ["accounts"]))
    more = settings.model_copy(update={"topics": settings.topics.model_copy(update={"partitions": 5})})
    report = await ensure_topics(more, topic_specs(more, ["accounts"]))
    assert report.created == []
    assert any("changelog has 3 partitions, expected 5" in p for p in report.problems)

    specs = topic_specs(settings, ["accounts"])
    changelog = TopicNames(settings.app).changelog
    wrong = [s if s.name != changelog else s.__class__(s.name, s.partitions, s.replication_factor,
             {**s.configs, "cleanup.policy": "delete"}) for s in specs]
    report = await ensure_topics(settings, wrong)
    assert report.problems == [f"{changelog} has cleanup.policy=compact, expected delete"]

    # an events topic that deletes events after a week (made by hand, or by the broker's
    # defaults before `esk topics init`): the source of truth would go
    events = TopicNames(settings.app).events("accounts")
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.bootstrap_servers)
    await admin.start()
    try:
        await admin.alter_configs([ConfigResource(ConfigResourceType.TOPIC, events, configs={"retention.ms": "604800000"})])
    finally:
        await admin.close()
    report = await ensure_topics(settings, specs)
    assert report.problems == [
        f"{events} has retention.ms=604800000, expected -1 (events are kept forever, and Kafka deletes them past any other: "
        f"`kafka-configs.sh --alter --entity-type topics --entity-name {events} --add-config retention.ms=-1`)"
    ]


def test_topics_init_refused_by_the_cluster_says_so_in_a_line(settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cluster that answers but refuses a topic request (an ACL without DescribeConfigs,
    say): one error line, not a traceback (tests/security has a real authorizer refuse)."""

    async def refused(*_: object) -> None:
        raise TopicAuthorizationFailedError("the configs of t.accounts.events: not authorized")

    monkeypatch.setenv("ESK_APP", settings.app)
    monkeypatch.setenv("ESK_KAFKA__BOOTSTRAP_SERVERS", settings.bootstrap_servers)
    monkeypatch.setenv("COLUMNS", "250")
    monkeypatch.setattr(esk_cli, "ensure_topics", refused)
    result = CliRunner().invoke(esk_cli.cli, ["topics", "init"])
    assert result.exit_code == 1
    assert result.output.strip() == (
        f"error: Kafka at {settings.bootstrap_servers} refused esk's clients: TOPIC_AUTHORIZATION_FAILED (the configs of "
        f"t.accounts.events: not authorized); `esk topics acls --principal User:<name>` prints the ACLs app '{settings.app}' needs"
    )


def test_topics_init_makes_the_parked_topics_of_the_kafka_kinds_subscriptions(settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each subscriber would make its own at its start: one whose principal may not create
    topics could not run (a walkthrough against a cluster with ACLs)."""
    app = f"{settings.app}-parked"
    monkeypatch.setenv("ESK_APP", app)
    monkeypatch.setenv("ESK_KAFKA__BOOTSTRAP_SERVERS", settings.bootstrap_servers)
    monkeypatch.setenv("ESK_SUBSCRIPTIONS", "subscriptions:SUBSCRIPTIONS")  # a reactor (payments) and a database handler
    result = CliRunner().invoke(esk_cli.cli, ["topics", "init"])
    assert result.exit_code == 0, result.output
    assert f"created  {app}.subscription.payments.parked" in result.output.splitlines()
    assert "customer_ledger" not in result.output  # its parked events are in its database


def test_esk_clients_never_make_a_topic_the_broker_would_make_on_its_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a cluster that makes a topic a client names (auto.create.topics.enable, Kafka's
    default), a processor or subscriber started before `esk topics init` would make its
    topics with the broker's defaults: esk's clients ask for no topic to be made."""
    properties = BrokerNode.properties
    monkeypatch.setattr(BrokerNode, "properties", lambda node: {**properties(node), "auto.create.topics.enable": "true"})
    embedded = EmbeddedBroker(BrokerSettings(port=free_port_pair(), data_dir=tmp_path / "b"))
    embedded.start()
    try:
        settings = Settings(app="auto", kafka={"bootstrap_servers": embedded.bootstrap}, _env_file=None)
        names = TopicNames("auto")

        async def read_and_write() -> set[str]:
            consumer = group_member(settings, "auto.processor", 10_000, 60_000)
            consumer.subscribe([names.commands])
            producer = AIOKafkaProducer(**{**client_options(settings), "request_timeout_ms": 3000})
            await producer.start()
            try:
                # its start asks for the topic's metadata at once, then waits for it (30 s)
                with contextlib.suppress(UnknownTopicOrPartitionError, TimeoutError):
                    await asyncio.wait_for(consumer.start(), 3)
                with pytest.raises((KafkaError, TimeoutError)):  # nor here: the send waits for a topic that does not come
                    await asyncio.wait_for(producer.send_and_wait(names.events("accounts"), b"x"), 5)
                admin = AIOKafkaAdminClient(**client_options(settings))
                await admin.start()
                try:
                    return set(await admin.list_topics())
                finally:
                    await admin.close()
            finally:
                await producer.stop()
                await consumer.stop()

        topics = asyncio.run(read_and_write())
        assert names.commands not in topics and names.events("accounts") not in topics, topics
    finally:
        embedded.stop()


def test_broker_restart_keeps_data_and_status_follows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # a cluster id that starts with "-" (1 in 64 random ids) must not read as an option
    leading_dash = uuid.UUID(bytes=b"\xf8" + bytes(15))
    monkeypatch.setattr("esk.broker.embedded.uuid.uuid4", lambda: leading_dash)
    embedded = EmbeddedBroker(BrokerSettings(port=free_port_pair(), data_dir=tmp_path / "b"))
    assert not embedded.status().running
    embedded.start()
    try:
        assert embedded.status().answering
        settings = Settings(app="restart", kafka={"bootstrap_servers": embedded.bootstrap}, _env_file=None)
        topic = TopicNames("restart").commands
        asyncio.run(ensure_topics(settings, topic_specs(settings, [])))
        # a new broker's group and transaction coordinators waited for (as `topics init`
        # does), then answering at the first request: no member logs errors until they are;
        # nor does the wait, which expects them not to answer at first
        with caplog.at_level(logging.DEBUG, logger="esk.kafka.admin"):
            assert asyncio.run(coordinators_ready(settings)) is None
        waited = [r for r in caplog.records if "admin request failed" in r.getMessage()]
        assert waited and all(r.levelno == logging.DEBUG for r in waited), [(r.levelname, r.getMessage()) for r in waited]
        assert asyncio.run(_coordinators(settings, "restart.processor")) == [1, 1]

        async def produce() -> None:
            producer = AIOKafkaProducer(bootstrap_servers=embedded.bootstrap, acks="all")
            await producer.start()
            await producer.send_and_wait(topic, b"kept", partition=0)
            await producer.stop()

        asyncio.run(produce())
        assert embedded.stop()
        assert not embedded.status().running
        embedded.start()
        assert asyncio.run(_read_all(settings, topic, "read_committed")) == [b"kept"]
    finally:
        embedded.stop()
    assert not embedded.stop()  # stopping a stopped broker says so


def test_a_busy_port_is_a_clear_error(broker: EmbeddedBroker, tmp_path: Path) -> None:
    clash = EmbeddedBroker(BrokerSettings(port=broker.settings.port, data_dir=tmp_path / "clash"))
    with pytest.raises(BrokerError, match=f"port {broker.settings.port} .* is busy"):
        clash.start()


def test_ports_for_servers_lie_below_the_range_client_connections_take_theirs_from() -> None:
    """A server's port in the ephemeral range may be some client's local end by the time the
    server (re)binds it: the broker of a test failed so, 'Address already in use'."""
    first_ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for _ in range(20):
        pair, single = free_port_pair(), free_port()
        assert pair + 1 < first_ephemeral and single < first_ephemeral
        assert port_is_free("127.0.0.1", pair) and port_is_free("127.0.0.1", pair + 1)


def test_ports_for_servers_are_drawn_beside_any_ephemeral_range() -> None:
    assert _server_ranges(32768, 60999, 2) == range(20768, 32767)  # Linux's default: below
    assert _server_ranges(1200, 40000, 1) == range(40001, 52001)  # no room below: above
    assert _server_ranges(1024, 65535, 2) == range(1024, 65535)  # no room outside: any, rather than none


def test_missing_java_is_a_clear_error(tmp_path: Path) -> None:
    embedded = EmbeddedBroker(
        BrokerSettings(port=free_port_pair(), data_dir=tmp_path / "b", java="no-such-java")
    )
    with pytest.raises(BrokerError, match="Java not found"):
        embedded.start()


async def _coordinators(settings: Settings, key: str) -> list[int]:
    admin = AIOKafkaAdminClient(**client_options(settings))
    await admin.start()
    try:
        return [await admin.find_coordinator(key, coordinator_type) for coordinator_type in (0, 1)]
    finally:
        await admin.close()


def test_a_processor_started_before_its_broker_waits_for_it(tmp_path: Path) -> None:
    """A long-running process waits for a broker that is down at its start (its client would
    end it with "Unable to bootstrap"), and goes on once one answers."""
    embedded = EmbeddedBroker(BrokerSettings(port=free_port_pair(), data_dir=tmp_path / "b"))
    metrics_port = free_port()
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("ESK_")},
        "ESK_APP": "waits", "ESK_KAFKA__BOOTSTRAP_SERVERS": embedded.bootstrap,
        "ESK_PROCESSOR__STATE_DIR": str(tmp_path / "state"), "ESK_PROCESSOR__METRICS_PORT": str(metrics_port),
    }
    log = tmp_path / "processor.log"
    with log.open("wb") as out:
        started = subprocess.Popen([sys.executable, "-m", "esk", "processor"], env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_until_text(log, f"no Kafka broker answers at {embedded.bootstrap} yet: waiting for one", started)
        assert started.poll() is None
        # alive meanwhile (a liveness probe leaves it be), and not ready
        assert httpx.get(f"http://127.0.0.1:{metrics_port}/healthz", timeout=2).status_code == 200
        assert not _ready(metrics_port)
        embedded.start()
        wait_until_text(log, f"Kafka at {embedded.bootstrap} answers: starting", started)
        # and for its topics (started beside `esk topics init`, a Job say), in a line
        wait_until_text(log, "no topic waits.commands, waits.results, waits.changelog, waits.dlq, waits.schemas, waits.accounts.events", started)
        settings = Settings(app="waits", kafka={"bootstrap_servers": embedded.bootstrap}, _env_file=None)
        asyncio.run(ensure_topics(settings, topic_specs(settings, load_registry(settings.domain))))
        wait_until_text(log, "the topics are there: starting", started)
        deadline = time.monotonic() + 60
        while not _ready(metrics_port):  # and handles its partitions
            assert started.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        started.send_signal(signal.SIGTERM)
        assert started.wait(30) == 0
        assert "the processor stopped (SIGTERM)" in log.read_text()  # a clean stop, in its log
    finally:
        started.send_signal(signal.SIGTERM)
        started.wait(30)
        embedded.stop()


def wait_until_text(log: Path, text: str, process: subprocess.Popen[bytes], timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in log.read_text():
        assert process.poll() is None, f"it ended:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no {text!r} in:\n{log.read_text()[-3000:]}"
        time.sleep(0.2)


def _ready(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def test_a_processor_stops_on_sigterm_while_its_start_waits(settings: Settings, tmp_path: Path) -> None:
    """It waits for topics that are not there yet: a SIGTERM meanwhile stops it at once,
    cleanly."""
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("ESK_")},
        "ESK_APP": f"no-topics-{uuid.uuid4().hex[:6]}", "ESK_KAFKA__BOOTSTRAP_SERVERS": settings.bootstrap_servers,
        "ESK_PROCESSOR__STATE_DIR": str(tmp_path / "state"), "ESK_PROCESSOR__METRICS_PORT": str(free_port()),
    }
    started = subprocess.Popen([sys.executable, "-m", "esk", "processor"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(4)  # well into the consumer's start
        assert started.poll() is None
        sent = time.monotonic()
        started.send_signal(signal.SIGTERM)
        assert started.wait(15) == 0
        assert time.monotonic() - sent < 10
    finally:
        started.kill()
        started.wait()
