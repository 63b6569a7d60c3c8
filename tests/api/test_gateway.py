"""The API's way onto the commands topic, against the real broker: a producer that an
error it cannot retry has stopped is replaced, so the API takes commands again; once a
command found no broker, the others are refused at once until one answers."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from pathlib import Path

import pytest
from aiokafka.errors import KafkaError
from prometheus_client import REGISTRY

from esk.api.gateway import CommandGateway, KafkaAway
from esk.broker import EmbeddedBroker
from esk.broker.ports import free_port_pair
from esk.kafka.topics import TopicNames, ensure_topics, topic_specs
from esk.protocol import CommandEnvelope
from esk.registry import load_registry
from esk.settings import BrokerSettings, Settings
from tests.conftest import own_settings
from tests.system import read_topic

pytestmark = pytest.mark.kafka


def deposit(command_id: str, note: str = "") -> CommandEnvelope:
    return CommandEnvelope(command_id, "accounts", "a1", "deposit", {"amount": 5, "note": note})


async def until_stored(
    gateway: CommandGateway, envelope: CommandEnvelope, timeout_s: float = 30, retried: tuple[type[Exception], ...] = (KafkaAway,)
) -> None:
    """`envelope` submitted as a client retries it (on `retried`): refused at once while no
    broker answers, then tried once one does."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            await gateway.submit(envelope)
            return
        except retried:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


async def test_a_producer_stopped_by_an_error_it_cannot_retry_is_replaced(settings: Settings) -> None:
    await ensure_topics(settings, topic_specs(settings, load_registry(settings.domain)))
    gateway = CommandGateway(settings)
    await gateway.start()
    try:
        await gateway.submit(deposit("before"))
        first = gateway._producer
        # larger than a request may be: no retry mends it (as none mends a sequence number
        # out of order once a broker came back, which ends an idempotent producer's sender)
        with pytest.raises(KafkaError) as failed:
            await gateway.submit(deposit("too-large", "x" * 2_000_000))
        assert not failed.value.retriable
        await gateway.submit(deposit("after"))
        assert gateway._producer is not None and gateway._producer is not first
    finally:
        await gateway.stop()
    stored = [value["command_id"] for _, value, _ in await read_topic(settings, TopicNames(settings.app).commands)]
    assert stored == ["before", "after"]


async def test_once_a_command_found_no_broker_the_others_are_refused_at_once_until_one_answers(tmp_path: Path) -> None:
    broker = EmbeddedBroker(BrokerSettings(port=free_port_pair(), data_dir=tmp_path / "broker"))
    await asyncio.to_thread(broker.start)
    settings = own_settings(broker, tmp_path)
    settings = settings.model_copy(update={"api": settings.api.model_copy(update={"submit_timeout_s": 2.0})})
    await ensure_topics(settings, topic_specs(settings, load_registry(settings.domain)))
    gateway = CommandGateway(settings)
    await gateway.start()
    try:
        await gateway.submit(deposit("before"))
        await asyncio.to_thread(broker.stop)
        started = time.monotonic()
        with pytest.raises(TimeoutError):  # found out the slow way, bounded (aiokafka would retry for ever)
            await gateway.submit(deposit("timed-out-1"))
        assert 2.0 <= time.monotonic() - started < 5
        assert gateway.away_since is not None and REGISTRY.get_sample_value("esk_api_kafka_away") == 1
        for _ in range(3):
            started = time.monotonic()
            with pytest.raises(KafkaAway):
                await gateway.submit(deposit("refused"))
            assert time.monotonic() - started < 0.1
            await asyncio.sleep(0.5)

        await asyncio.to_thread(broker.start)
        await until_stored(gateway, deposit("after"))
        assert gateway.away_since is None and REGISTRY.get_sample_value("esk_api_kafka_away") == 0
        await gateway.submit(deposit("after-2"))

        await asyncio.to_thread(broker.stop)
        with pytest.raises(TimeoutError):
            await gateway.submit(deposit("timed-out-2"))
    finally:
        started = time.monotonic()
        await gateway.stop()  # with a record it cannot send: bounded too
        assert time.monotonic() - started < 4
    await asyncio.to_thread(broker.start)
    try:
        stored = [value["command_id"] for _, value, _ in await read_topic(settings, TopicNames(settings.app).commands)]
    finally:
        await asyncio.to_thread(broker.stop)
    # Those that timed out may be stored after all (the producer retried them): their
    # clients retry under their keys. Those refused at once were never sent.
    assert [c for c in stored if not c.startswith("timed-out")] == ["before", "after", "after-2"]
    assert len(stored) == len(set(stored))


async def test_the_first_command_after_a_long_outage_is_taken(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A command timed out and expired in the producer while no broker answered: its
    sequence number went on, and the producer's next send, once a broker is back, was
    refused as out of order (OutOfOrderSequenceNumber), a 503 for a client just told that
    commands are taken again. The command that tries is sent again by a new producer, and
    an operator reads one WARNING for the outage, not one more for what follows it."""
    caplog.set_level(logging.INFO, logger="esk.api.gateway")
    broker = EmbeddedBroker(BrokerSettings(port=free_port_pair(), data_dir=tmp_path / "broker"))
    await asyncio.to_thread(broker.start)
    settings = own_settings(broker, tmp_path)
    settings = settings.model_copy(update={
        "api": settings.api.model_copy(update={"submit_timeout_s": 1.0}),
        "kafka": settings.kafka.model_copy(update={"request_timeout_ms": 2000}),  # its records expire within the outage
    })  # fmt: skip
    await ensure_topics(settings, topic_specs(settings, load_registry(settings.domain)))
    gateway = CommandGateway(settings)
    await gateway.start()
    try:
        await gateway.submit(deposit("before"))

        async def send_on() -> None:  # clients' commands, in flight as the broker goes
            for n in range(1000):
                with contextlib.suppress(KafkaError, TimeoutError, KafkaAway):
                    await gateway.submit(deposit(f"timed-out-{n}"))

        sending = [asyncio.create_task(send_on()) for _ in range(12)]
        await asyncio.sleep(0.5)
        await asyncio.to_thread(broker.stop)
        await asyncio.sleep(3)  # past its request timeout: the producer gave its records up
        for task in sending:
            task.cancel()
        await asyncio.gather(*sending, return_exceptions=True)
        await asyncio.to_thread(broker.start)
        await until_stored(gateway, deposit("after"))  # the one that tries: not refused as out of order
    finally:
        await gateway.stop()
        await asyncio.to_thread(broker.stop)
    warned = [r.getMessage() for r in caplog.records if r.name == "esk.api.gateway" and r.levelno >= logging.WARNING]
    assert len(warned) == 1 and warned[0].startswith("a command was not stored ("), warned

