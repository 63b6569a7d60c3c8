"""esk's logging (esk.logs): what an operator reads while a broker is away, and JSON lines.

The filter is driven through the real loggers with aiokafka's own format strings and
error types; the last test runs a real client against a broker that is stopped and
started again."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
import re
import ssl
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import (
    KafkaError,
    NodeNotReadyError,
    NotLeaderForPartitionError,
    RequestTimedOutError,
    SaslAuthenticationFailed,
    TopicAuthorizationFailedError,
)
from pydantic import ValidationError
from pythonjsonlogger.orjson import OrjsonFormatter
from typer.testing import CliRunner

from esk.broker import EmbeddedBroker
from esk.broker.ports import free_port_pair
from esk.cli import cli, load_settings
from esk.logs import (
    AFTER_OUTAGE_S,
    AUTHENTICATED,
    BOOTSTRAP_FAILED,
    CONNECT_FAILED,
    CONNECTING,
    METADATA_FAILED,
    RECOVERY_GRACE_S,
    RESPONSE,
    SUMMARY_INTERVAL_S,
    configure_logging,
)
from esk.settings import BrokerSettings, Settings

CLIENT = logging.getLogger("aiokafka")  # aiokafka/client.py logs on the package's logger
CONN = logging.getLogger("aiokafka.conn")
FETCHER = logging.getLogger("aiokafka.consumer.fetcher")
SENDER = logging.getLogger("aiokafka.producer.sender")
COORDINATOR = logging.getLogger("aiokafka.consumer.group_coordinator")
TOUCHED = ("", "aiokafka", "py4j")


@pytest.fixture(autouse=True)
def logging_put_back() -> Iterator[None]:
    """Each test configures logging as an esk process does; the suite's comes back after."""
    root = logging.getLogger()
    handlers = list(root.handlers)
    levels = {name: logging.getLogger(name).level for name in TOUCHED}
    yield
    for handler in [h for h in root.handlers if h not in handlers]:
        root.removeHandler(handler)
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)


@pytest.fixture
def output() -> io.StringIO:
    """What esk's handler writes."""
    stream = io.StringIO()
    configure_logging("INFO", "text", stream)
    return stream


def lines(stream: io.StringIO) -> list[str]:
    return stream.getvalue().splitlines()


def refused(port: int) -> OSError:
    return ConnectionRefusedError(111, f"Connect call failed ('127.0.0.1', {port})")


def outage_noise(node: int, port: int, times: int) -> None:
    """What aiokafka logs while node `node` is down, `times` over."""
    for _ in range(times):
        CLIENT.error(CONNECT_FAILED, node, refused(port))
        CLIENT.debug(CONNECTING, node, "127.0.0.1", port)  # the next attempt
        FETCHER.error("Failed fetch messages from %s: %s", node, NodeNotReadyError(f"not ready (node id {node})"))
        SENDER.warning("Got error produce response: %s", NodeNotReadyError(f"not ready (node id {node})"))
        SENDER.warning(
            "Got error produce response on topic-partition %s, retrying. Error: %s", "TopicPartition('a.results', 0)",
            NotLeaderForPartitionError,
        )
        CLIENT.error(METADATA_FAILED, [1, 2, 3])  # with one broker, the client loops on it


def test_a_broker_outage_is_said_once_and_its_end_once(output: io.StringIO) -> None:
    outage_noise(2, 9093, times=200)
    [unreachable] = lines(output)
    assert re.search(r" WARNING aiokafka: Kafka broker node 2 unreachable \(\[Errno 111\] Connect call failed", unreachable)
    assert CLIENT.level == logging.DEBUG, "lowered to see the broker answer again"
    CONN.debug(RESPONSE, "127.0.0.1", 9094, 7, "MetadataResponse(...)")  # another broker answering: no news
    assert len(lines(output)) == 1
    CONN.debug(RESPONSE, "127.0.0.1", 9093, 8, "MetadataResponse(...)")
    unreachable, back = lines(output)
    assert re.search(
        r" INFO aiokafka.conn: Kafka broker node 2 \(127.0.0.1:9093\) reachable again after 200 failed connection attempts "
        r"over \d+\.\d s \(800 retried client errors logged at DEBUG meanwhile\)$", back
    ), back
    assert CLIENT.level == logging.WARNING, "back to quiet"
    CLIENT.error(CONNECT_FAILED, 2, refused(9093))  # an attempt begun before it answered
    assert len(lines(output)) == 2, "no new outage"


def test_a_broker_that_refuses_the_credentials_is_told_so_and_back_once_they_are_taken(output: io.StringIO) -> None:
    """A password rotated on the cluster: the broker answers every attempt (ApiVersions,
    before the SASL handshake), which read as \"reachable again\" after each refusal."""
    for _ in range(50):
        CLIENT.debug(CONNECTING, 1, "127.0.0.1", 9093)
        CLIENT.error(CONNECT_FAILED, 1, SaslAuthenticationFailed("invalid credentials"))
        CONN.debug(RESPONSE, "127.0.0.1", 9093, 1, "ApiVersionsResponse(...)")
    [refused] = lines(output)
    assert refused.endswith(
        "WARNING aiokafka: Kafka broker node 1 refuses esk's client ([Error 58] SaslAuthenticationFailed: invalid credentials): check "
        "ESK_KAFKA__SASL_PLAIN_USERNAME and ESK_KAFKA__SASL_PLAIN_PASSWORD (changed on the cluster?); the Kafka client keeps "
        "retrying, its errors are logged at DEBUG until the broker takes it again"
    ), refused
    CONN.info(AUTHENTICATED, "esk", "SCRAM-SHA-512")
    refused, back = lines(output)
    assert "Kafka broker node 1 (127.0.0.1:9093) reachable again after 50 failed connection attempts" in back, back


def test_a_broker_away_that_answers_with_a_certificate_not_trusted_is_told_so(output: io.StringIO) -> None:
    """Restarted with a certificate of another CA: its first refusals are not its outage's."""
    outage_noise(2, 9093, times=3)
    untrusted = ssl.SSLCertVerificationError(1, "[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed: self-signed certificate in certificate chain")
    for _ in range(20):
        CLIENT.error(CONNECT_FAILED, 2, untrusted)
    unreachable, refused = lines(output)
    assert "node 2 unreachable ([Errno 111] Connect call failed" in unreachable
    assert "node 2 refuses esk's client ([SSL: CERTIFICATE_VERIFY_FAILED]" in refused and "check ESK_KAFKA__SSL_CAFILE" in refused, refused


def test_a_broker_that_fails_again_later_is_a_new_outage(output: io.StringIO, monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1000.0]
    monkeypatch.setattr(time, "time", lambda: now[0])  # LogRecord.created
    outage_noise(2, 9093, times=2)
    now[0] += 3
    CONN.debug(RESPONSE, "127.0.0.1", 9093, 8, "MetadataResponse(...)")
    now[0] += RECOVERY_GRACE_S
    outage_noise(2, 9093, times=2)
    assert ["unreachable" in line for line in lines(output)] == [True, False, True]
    assert "after 2 failed connection attempts over 3.0 s (" in lines(output)[1]


def test_a_broker_reached_long_after_its_last_failed_attempt_says_when_that_was(output: io.StringIO, monkeypatch: pytest.MonkeyPatch) -> None:
    """A process that needed the broker for nothing for a while after it came back."""
    now = [1000.0]
    monkeypatch.setattr(time, "time", lambda: now[0])
    outage_noise(2, 9093, times=1)
    now[0] += 60
    outage_noise(2, 9093, times=1)
    now[0] += 120
    CONN.debug(RESPONSE, "127.0.0.1", 9093, 8, "MetadataResponse(...)")
    assert (
        "Kafka broker node 2 (127.0.0.1:9093) reached again 120.0 s after the last of 2 failed connection attempts over "
        "60.0 s (no request needed it meanwhile: it was away for 60.0 to 180.0 s) ("
    ) in lines(output)[1]


def test_at_debug_the_repeats_are_there_and_the_client_debug_lines_are_not() -> None:
    stream = io.StringIO()
    configure_logging("DEBUG", "text", stream)
    outage_noise(1, 9092, times=2)
    CONN.debug(RESPONSE, "127.0.0.1", 9092, 3, "FetchResponse(...)")
    levels_seen = [line.split()[2] for line in lines(stream)]
    assert levels_seen == ["WARNING", *["DEBUG"] * 9, "INFO"], lines(stream)
    assert not any("Initiating connection" in line for line in lines(stream)), "aiokafka's own DEBUG lines stay out"


def test_a_bootstrap_address_is_a_broker_too(output: io.StringIO) -> None:
    for _ in range(5):
        CLIENT.error(BOOTSTRAP_FAILED, "10.0.0.7", 9092, refused(9092))
    CONN.debug(RESPONSE, "10.0.0.7", 9092, 1, "MetadataResponse(...)")
    assert [line.split(" ", 3)[3] for line in lines(output)] == [
        "aiokafka: Kafka broker 10.0.0.7:9092 unreachable ([Errno 111] Connect call failed ('127.0.0.1', 9092)); the Kafka "
        "client keeps retrying, its errors are logged at DEBUG until the broker answers again",
        "aiokafka.conn: Kafka broker 10.0.0.7:9092 reachable again after 5 failed connection attempts over 0.0 s "
        "(0 retried client errors logged at DEBUG meanwhile)",
    ]


def test_retried_errors_with_every_broker_up_are_summed_up_once_a_minute(output: io.StringIO, monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1000.0]
    monkeypatch.setattr(time, "time", lambda: now[0])  # LogRecord.created
    retried = ("Got error produce response on topic-partition %s, retrying. Error: %s", "TopicPartition('a.events', 1)")
    SENDER.warning(*retried, NotLeaderForPartitionError)
    for _ in range(30):
        now[0] += 1
        SENDER.warning(*retried, NotLeaderForPartitionError)
        FETCHER.error("Failed fetch messages from %s: %s", 3, RequestTimedOutError())
    assert len(lines(output)) == 1, "the first is said at once, the next minute's are summed up"
    now[0] += SUMMARY_INTERVAL_S
    SENDER.warning(*retried, NotLeaderForPartitionError)
    first, summary = lines(output)
    assert "the Kafka client retried 1 request (NotLeaderForPartitionError x1), latest: Got error produce response" in first
    assert " WARNING " in summary and "retried 61 requests (NotLeaderForPartitionError x31, RequestTimedOutError x30)" in summary


def test_a_group_member_losing_its_coordinator_is_a_retried_error(output: io.StringIO) -> None:
    """What a consumer in a group says once its broker comes back after its session
    expired: it finds the coordinator again and rejoins on its own."""

    def coordinator_lost() -> None:
        COORDINATOR.error("Heartbeat session expired - marking coordinator dead")
        COORDINATOR.warning("Marking the coordinator dead (node %s)for group %s.", 1, "app.processor")
        COORDINATOR.warning(
            "Heartbeat failed for group %s: coordinator (node %s) is either not started or not valid", "app.processor", 1
        )

    outage_noise(1, 9092, times=1)
    coordinator_lost()
    assert len(lines(output)) == 1, "the outage's one line"
    CONN.debug(RESPONSE, "127.0.0.1", 9092, 8, "MetadataResponse(...)")
    coordinator_lost()  # said after the broker answered again
    unreachable, back, summary = lines(output)
    assert "unreachable" in unreachable and "reachable again" in back
    assert " WARNING " in summary and "retried 1 request (heartbeat session expired x1)" in summary, summary


def test_a_session_that_expires_with_every_broker_up_is_told_as_such(output: io.StringIO, monkeypatch: pytest.MonkeyPatch) -> None:
    """Not a retried request: the member's process held its loop up (or the coordinator
    answered too slowly), and the member may have lost its partitions."""
    now = [1000.0]
    monkeypatch.setattr(time, "time", lambda: now[0])
    outage_noise(1, 9092, times=1)
    CONN.debug(RESPONSE, "127.0.0.1", 9092, 8, "MetadataResponse(...)")
    now[0] += AFTER_OUTAGE_S
    COORDINATOR.error("Heartbeat session expired - marking coordinator dead")
    COORDINATOR.error("Heartbeat session expired - marking coordinator dead")
    expired = lines(output)[2:]
    assert len(expired) == 2 and all(" WARNING aiokafka" in line for line in expired), expired
    assert "heartbeat session expired while every broker answered: its process held up its event loop" in expired[0]


def test_a_rebalance_is_routine(output: io.StringIO) -> None:
    COORDINATOR.warning("Heartbeat failed for group %s because it is rebalancing", "app.processor")
    [line] = lines(output)
    assert " INFO aiokafka.consumer.group_coordinator: Heartbeat failed for group app.processor because it is rebalancing" in line


def test_what_the_client_does_not_retry_and_other_loggers_are_untouched(output: io.StringIO) -> None:
    FETCHER.warning("Not authorized to read from topic %s.", "secret")
    SENDER.error("Could not add partition %s due to unexpected error: %s", "tp", TopicAuthorizationFailedError)
    logging.getLogger("esk.processing").error("partition %d: commit failed (%r); restarting its task", 3, NodeNotReadyError())
    assert [line.split(" ", 2)[2] for line in lines(output)] == [
        "WARNING aiokafka.consumer.fetcher: Not authorized to read from topic secret.",
        "ERROR aiokafka.producer.sender: Could not add partition tp due to unexpected error: "
        "<class 'aiokafka.errors.TopicAuthorizationFailedError'>",
        "ERROR esk.processing: partition 3: commit failed (NodeNotReadyError()); restarting its task",
    ]


def test_json_lines() -> None:
    stream = io.StringIO()
    handler = configure_logging("INFO", "json", stream)
    logging.getLogger("esk.test").warning("partition %d: fenced", 4, extra={"trace_id": "abc"})
    try:
        raise ValueError("bad")
    except ValueError:
        logging.getLogger("esk.test").exception("it failed")
    logging.getLogger("esk.test").debug("below the level")
    assert configure_logging("INFO", "json", stream) is not handler
    logging.getLogger("esk.test").info("once, not twice: the handler was replaced")
    first, second, third = (json.loads(line) for line in lines(stream))
    assert first.keys() == {"timestamp", "level", "logger", "message", "trace_id"}
    assert (first["level"], first["logger"], first["message"], first["trace_id"]) == ("WARNING", "esk.test", "partition 4: fenced", "abc")
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d+\+00:00", first["timestamp"])
    assert second["level"] == "ERROR" and second["exception"].startswith("Traceback") and "ValueError: bad" in second["exception"]
    assert third["message"] == "once, not twice: the handler was replaced"


def test_the_log_format_setting(monkeypatch: pytest.MonkeyPatch, output: io.StringIO) -> None:
    assert Settings(_env_file=None).log_format == "text"
    monkeypatch.setenv("ESK_LOG_FORMAT", "json")
    assert Settings(_env_file=None).log_format == "json"
    load_settings()  # what every esk command starts with
    [handler] = [h for h in logging.getLogger().handlers if h.get_name() == "esk"]
    assert isinstance(handler.formatter, OrjsonFormatter)
    monkeypatch.setenv("ESK_LOG_FORMAT", "yaml")
    with pytest.raises(ValidationError):
        Settings(_env_file=None)


def test_an_error_that_ends_a_command_is_a_json_line_among_the_others(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ESK_LOG_FORMAT", "json")
    result = CliRunner().invoke(cli, ["project", "parked", "no_such_read_model"])
    assert result.exit_code == 1
    [line] = result.stderr.splitlines()
    said = json.loads(line)
    assert said["level"] == "ERROR" and said["message"].startswith("no read model 'no_such_read_model'"), said
    monkeypatch.setenv("ESK_LOG_FORMAT", "text")
    result = CliRunner().invoke(cli, ["project", "parked", "no_such_read_model"])
    assert result.exit_code == 1 and result.stderr.startswith("error: no read model 'no_such_read_model'"), result.stderr


# -- a real client, a real broker that goes away and comes back -----------------------------


async def test_a_stopped_and_restarted_broker_is_a_few_lines_not_hundreds(tmp_path: Path, output: io.StringIO) -> None:
    broker = EmbeddedBroker(BrokerSettings(port=free_port_pair(), data_dir=tmp_path / "broker"))
    await asyncio.to_thread(broker.start)
    admin = AIOKafkaAdminClient(bootstrap_servers=broker.bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic("logs", 1, 1)])
    finally:
        await admin.close()
    producer = AIOKafkaProducer(bootstrap_servers=broker.bootstrap, request_timeout_ms=2000, retry_backoff_ms=50)
    sent = 0
    wanted = 1 << 30  # until the broker is back
    enough = asyncio.Event()

    async def send_all_along(stop: asyncio.Event) -> None:
        nonlocal sent
        while not stop.is_set():
            try:
                await asyncio.wait_for(producer.send_and_wait("logs", b"x"), 2)
                sent += 1
                if sent >= wanted:
                    enough.set()
            except (KafkaError, TimeoutError):
                pass
            await asyncio.sleep(0.02)

    try:
        await producer.start()
        stop = asyncio.Event()
        sending = asyncio.create_task(send_all_along(stop))
        await asyncio.sleep(1)
        await asyncio.to_thread(broker.stop)
        await asyncio.sleep(2)  # the client retries all along
        await asyncio.to_thread(broker.start)
        before = sent
        wanted = before + 5
        with contextlib.suppress(TimeoutError):  # asserted below
            await asyncio.wait_for(enough.wait(), 30)
        stop.set()
        await sending
    finally:
        await producer.stop()
        await asyncio.to_thread(broker.stop)
    said = [line for line in lines(output) if " aiokafka" in line]
    loud = [line for line in said if re.search(r" (WARNING|ERROR|CRITICAL) ", line)]
    assert sent > before, "the producer sent again once the broker was back"
    assert len(loud) <= 3, said  # the unreachable line, and at most a retried error or two said once
    assert sum("unreachable" in line for line in loud) == 1, said
    [back] = [line for line in said if "reachable again" in line]
    attempts = int(re.search(r"after (\d+) failed connection attempts", back)[1])  # type: ignore[index]
    retried = int(re.search(r"\((\d+) retried client errors", back)[1])  # type: ignore[index]
    assert attempts + retried >= 20, f"the lines this kept at DEBUG: {back}"
