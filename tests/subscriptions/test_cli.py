"""`esk subscriber` and `esk subscriptions …` as a user types them, against the real broker:
the example subscriptions listed, their lag shown per partition, a reset refused while a
Kafka-offset subscription has a running member and done once it has none, a database
handler's replay, parked events listed and skipped with a record of who did it."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from aiokafka import AIOKafkaProducer
from typer.testing import CliRunner

from bench.cluster import metric_sum, wait_until
from esk.broker.ports import free_port
from esk.cli import cli
from esk.kafka.client_options import client_options
from esk.kafka.topics import TopicNames, ensure_topics, topic_specs
from esk.protocol import EventRecord
from esk.registry import load_registry
from esk.settings import Settings

pytestmark = pytest.mark.kafka


def placed(order_id: str, customer: str, data: dict[str, object] | None = None) -> EventRecord:
    payload = data if data is not None else {"customer_id": customer, "lines": [{"sku": "a", "qty": 1, "price": 5}]}
    return EventRecord(f"orders/{order_id}/1", "orders", order_id, 1, "Placed", 1, payload, "c", "c", "c", 0)


async def write_events(settings: Settings, events: list[EventRecord]) -> None:
    await ensure_topics(settings, topic_specs(settings, load_registry(settings.domain)))
    producer = AIOKafkaProducer(**client_options(settings), acks="all")
    await producer.start()
    try:
        for event in events:
            await producer.send_and_wait(TopicNames(settings.app).events("orders"), event.encode(), key=event.aggregate_id.encode(), headers=event.headers())
    finally:
        await producer.stop()


@pytest.fixture
def env(settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    variables = {
        "ESK_APP": settings.app,
        "ESK_KAFKA__BOOTSTRAP_SERVERS": settings.bootstrap_servers,
        "ESK_TOPICS__PARTITIONS": str(settings.topics.partitions),
        "ESK_SUBSCRIBER__DATA_DIR": str(tmp_path / "subscriptions"),
        "ESK_SUBSCRIBER__METRICS_PORT": "0",
        "COLUMNS": "250",  # the tables whole, not cut to 80 columns
    }
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    return variables


def esk(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, list(args))
    return result.exit_code, result.output


def test_the_subscriptions_commands(settings: Settings, env: dict[str, str], tmp_path: Path) -> None:
    # An order whose Placed cannot be read (a number for a customer): the ledger parks it.
    asyncio.run(write_events(settings, [placed("o1", "c1"), placed("o2", "c2"), placed("o3", "", {"customer_id": 7})]))

    code, out = esk("subscriptions", "list")
    assert code == 0 and "payments" in out and "customer_ledger" in out and "outcome of Withdraw" in out

    code, out = esk("subscriptions", "status", "customer_ledger")
    assert code == 1 and "3 behind" in out
    # before its subscriber ran, or read from another data directory: nothing is made there
    data_dir = Path(env["ESK_SUBSCRIBER__DATA_DIR"])
    assert f"no database at {data_dir / 'customer_ledger.sqlite'}: its subscriber has not run with" in out
    assert not data_dir.exists()
    code, out = esk("subscriptions", "parked", "customer_ledger")
    assert code == 1 and "no database at" in out and not data_dir.exists()
    code, out = esk("subscriptions", "reset", "customer_ledger", "--to", "earliest")  # moves it on before its first run
    assert code == 0 and (data_dir / "customer_ledger.sqlite").exists(), out

    port = free_port()
    subscriber = subprocess.Popen(
        [sys.executable, "-m", "esk", "subscriber", "customer_ledger"],
        env={**os.environ, "ESK_SUBSCRIBER__METRICS_PORT": str(port)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_until(lambda: esk("subscriptions", "status", "customer_ledger")[0] == 2, 60, "the ledger to catch up, o3 parked")
        wait_until(lambda: _metric(port, "esk_subscription_caught_up") == 1.0, 30, "the metric to say so")
        code, out = esk("subscriptions", "parked", "customer_ledger")
        assert code == 0 and "o3" in out and "undecodable" in out and "1 parked" in out
        code, out = esk("subscriptions", "status", "customer_ledger")  # caught up, and says what it holds back
        assert code == 2 and "customer_ledger: caught up; 1 parked (esk subscriptions parked customer_ledger)" in out
        # counted as what needs an operator (its alert's), not as waiting for newer code
        wait_until(lambda: _metric(port, "esk_subscription_parked", result="parked") == 1.0, 30, "the subscriber to count it")
        assert _metric(port, "esk_subscription_parked", result="parked_newer_version") == 0.0

        # while it runs: the offsets are its database's; o3, still parked, is marked reset
        code, out = esk("subscriptions", "reset", "customer_ledger", "--to", "earliest", "--by", "ops@example")
        assert code == 0 and "reset to earliest" in out
        wait_until(lambda: esk("subscriptions", "parked", "customer_ledger")[1].count("o3") == 1, 60, "the replay to park o3 again")
        assert "reset by ops@example at " in esk("subscriptions", "parked", "customer_ledger")[1]

        code, out = esk("subscriptions", "skip", "customer_ledger", "--aggregate", "o3", "--by", "ops@example")
        assert code == 0 and "1 skipped" in out
        code, out = esk("subscriptions", "parked", "customer_ledger", "--all")
        assert "skipped" in out and "ops@example" in out
        # A replay parks it again; its entry keeps who skipped it the first time.
        assert esk("subscriptions", "reset", "customer_ledger", "--to", "earliest")[0] == 0
        wait_until(lambda: "skipped by ops@example at " in esk("subscriptions", "parked", "customer_ledger")[1], 60, "the replay to park o3 again")
        # for a script: every field, each resolution before it in a list
        code, out = esk("subscriptions", "parked", "customer_ledger", "--format", "json")
        (entry,) = [json.loads(line) for line in out.splitlines()]
        assert code == 0 and (entry["aggregate_id"], entry["status"]) == ("o3", "parked") and "undecodable" in entry["reason"], out
        assert [(r["status"], r["by"]) for r in entry["earlier"]] == [("reset", "ops@example"), ("skipped", "ops@example")], out
        code, out = esk("subscriptions", "parked", "customer_ledger", "--format", "csv")
        assert code == 0 and out.splitlines()[0].startswith("aggregate_id,event_type,topic,partition,offset,") and len(out.splitlines()) == 2, out
        code, out = esk("subscriptions", "parked", "customer_ledger", "--format", "xml")
        assert code == 2 and "Invalid value for '--format'" in out and "'xml' is not one of 'table', 'csv', 'json'" in out, out
        code, out = esk("subscriptions", "skip", "customer_ledger", "--aggregate", "o3", "--by", "ops@example")
        assert code == 0 and "1 skipped" in out
        # skipped from the command line, under the running subscriber: it counts from its store
        wait_until(lambda: _metric(port, "esk_subscription_parked") == 0.0, 30, "the subscriber to count none")
        code, out = esk("subscriptions", "status", "customer_ledger")
        assert code == 0 and "customer_ledger: caught up\n" in out, out
    finally:
        subscriber.send_signal(signal.SIGTERM)
        subscriber.wait(30)

    code, out = esk("subscriptions", "reset", "customer_ledger", "--to", "yesterday")
    assert code == 1 and "ISO 8601" in out
    code, out = esk("subscriber", "nope")
    assert code == 1 and "no subscription 'nope'" in out


def test_a_kafka_offset_subscription_is_reset_only_without_members(settings: Settings, env: dict[str, str]) -> None:
    asyncio.run(write_events(settings, [placed("o1", "c1")]))
    subscriber = subprocess.Popen([sys.executable, "-m", "esk", "subscriber", "payments"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: esk("subscriptions", "status", "payments")[0] == 0, 60, "payments to catch up")
        code, out = esk("subscriptions", "reset", "payments", "--to", "earliest")
        assert code == 1 and "running member" in out and "stop its `esk subscriber` processes first" in out
    finally:
        subscriber.send_signal(signal.SIGTERM)
        subscriber.wait(30)
    # a time still to come would move every offset to the end, skipping all: refused
    code, out = esk("subscriptions", "reset", "payments", "--to", "2999-01-01T00:00:00+00:00")
    assert code == 1 and "cannot replay from 2999-01-01T00:00:00+00:00, a time still to come" in out, out
    code, out = esk("subscriptions", "status", "payments")
    assert code == 0, out  # nothing moved
    code, out = esk("subscriptions", "reset", "payments", "--to", "2000-01-01T00:00:00+00:00")
    assert code == 0, out
    code, out = esk("subscriptions", "status", "payments")
    assert code == 1 and "1 behind" in out


def _metric(port: int, name: str, **labels: str) -> float | None:
    try:
        return metric_sum(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2).text, name, **labels)
    except httpx.HTTPError:
        return None


@pytest.mark.parametrize(
    ("args", "needs"),
    [
        (("subscriptions", "status", "customer_ledger"), "looking at or changing a subscription"),
        (("subscriptions", "parked", "customer_ledger"), "looking at or changing a subscription"),
        (("subscriptions", "retry", "customer_ledger"), "looking at or changing a subscription"),
        (("state", "unusable"), "reading the changelog"),
    ],
)
def test_an_operation_without_a_broker_is_told_in_one_line(args: tuple[str, ...], needs: str, monkeypatch: pytest.MonkeyPatch) -> None:
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    monkeypatch.setenv("ESK_KAFKA__BOOTSTRAP_SERVERS", address)
    code, output = esk(*args)
    assert code == 1
    assert output.strip().splitlines() == [
        f"error: no Kafka broker answered at {address}, which {needs} needs: start one "
        "(`esk broker start`; `esk dev` starts its own), or set ESK_KAFKA__BOOTSTRAP_SERVERS to yours"
    ]


def test_a_status_that_kafka_does_not_answer_in_time_is_told_in_one_line(
    settings: Settings, env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A broker answers and the group's coordinator does not (two of a cluster's three nodes
    killed: its admin requests fail for the minute they are asked again): one line, and the
    others' status still told, where a traceback of 120 lines ended the command."""
    from aiokafka.errors import NodeNotReadyError

    from esk import cli as esk_cli

    asked = esk_cli.subscription_operations

    def failing_for_ledger(settings: Settings, name: str) -> object:
        operations = asked(settings, name)
        if name == "customer_ledger":

            async def status() -> None:
                raise NodeNotReadyError("Attempt to send a request to node which is not ready (node id 1).")

            operations.status = status
        return operations

    asyncio.run(write_events(settings, []))  # the topics
    monkeypatch.setattr(esk_cli, "subscription_operations", failing_for_ledger)
    code, output = esk("subscriptions", "status")
    assert code == 1
    lines = output.splitlines()
    told = [line for line in lines if line.startswith("error:")]
    assert told == [
        "error: customer_ledger: Kafka did not answer in time (NodeNotReadyError('Attempt to send a request to node which is "
        "not ready (node id 1).'))"
    ], output
    assert "Traceback" not in output and any(line.startswith("payments:") for line in lines), output
