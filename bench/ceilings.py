"""Ceilings: what the Kafka clients and Kafka's own perf tools do with the same records
and no processing at all."""

from __future__ import annotations

import re
import subprocess
import time
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition

from esk.broker import EmbeddedBroker
from esk.kafka.client_options import client_options
from esk.kafka.metadata import topic_partitions
from esk.processing.record_collector import Output
from esk.processing.streams_producer import StreamsProducer
from esk.settings import Settings

# What one command writes, as the W1 targets count it: "about three". W1's commands write 3.7
# (0.84 events, the outcome, the changelog records of the aggregate and of the command),
# so the ceiling in commands per second this gives (bench/run.py) errs high, against esk.
# It also sizes the ceilings' transactions to a full batch's.
WRITES_PER_COMMAND = 3


def records_per_transaction(settings: Settings) -> int:
    """What a full batch of commands writes in its transaction."""
    return settings.processor.batch_max_records * WRITES_PER_COMMAND


async def aiokafka_consume(settings: Settings, topic: str, expected: int, isolation_level: str = "read_uncommitted") -> float:
    """Seconds to read `expected` records of `topic` from its beginning, and do nothing with them."""
    consumer = AIOKafkaConsumer(**client_options(settings), group_id=None, enable_auto_commit=False,
                                max_partition_fetch_bytes=4 * 1024 * 1024, isolation_level=isolation_level)
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in await topic_partitions(settings, topic)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        started = time.perf_counter()
        seen = 0
        while seen < expected:
            batches = await consumer.getmany(timeout_ms=1000, max_records=50_000)
            seen += sum(len(b) for b in batches.values())
        return time.perf_counter() - started
    finally:
        await consumer.stop()


async def aiokafka_transactional_produce(settings: Settings, topic: str, records: list[tuple[bytes, bytes]]) -> float:
    """The records sent the way the processor sends its outputs (its StreamsProducer), one
    transaction per `records_per_transaction`. Returns seconds."""
    producer = StreamsProducer(settings, f"{topic}-ceiling", f"{topic}-ceiling")
    await producer.start()
    try:
        per_transaction = records_per_transaction(settings)
        started = time.perf_counter()
        for start in range(0, len(records), per_transaction):
            await producer.commit([Output(topic, key, value) for key, value in records[start:start + per_transaction]], None, "")
        return time.perf_counter() - started
    finally:
        await producer.stop()


def confluent_rates(settings: Settings, records: list[tuple[bytes, bytes]], topic: str) -> list[tuple[str, float]]:
    """confluent-kafka (librdkafka) produce and consume of the same records, if installed;
    and produce in transactions of the processor's size, the row to set against
    aiokafka's for the processor's choice of client."""
    try:
        from confluent_kafka import Consumer, Producer
    except ImportError:
        return []
    conf = {"bootstrap.servers": settings.bootstrap_servers}
    producer = Producer({**conf, "acks": "all", "enable.idempotence": True, "linger.ms": 20})
    started = time.perf_counter()
    _confluent_produce(producer, topic, records)
    producer.flush()
    produce_s = time.perf_counter() - started
    consumer = Consumer({**conf, "group.id": f"{topic}-reader", "auto.offset.reset": "earliest", "enable.auto.commit": False})
    consumer.subscribe([topic])
    seen, started = 0, time.perf_counter()
    while seen < len(records):
        seen += len([m for m in consumer.consume(10_000, timeout=1.0) if m.error() is None])
    consume_s = time.perf_counter() - started
    consumer.close()
    transactional = Producer({**conf, "transactional.id": f"{topic}-confluent-ceiling", "linger.ms": 20})
    transactional.init_transactions()
    per_transaction = records_per_transaction(settings)
    started = time.perf_counter()
    for start in range(0, len(records), per_transaction):
        transactional.begin_transaction()
        _confluent_produce(transactional, topic, records[start:start + per_transaction])
        transactional.commit_transaction()
    transactional_s = time.perf_counter() - started
    return [
        ("confluent-kafka produce (acks=all)", len(records) / produce_s),
        ("confluent-kafka produce, in transactions of esk's size", len(records) / transactional_s),
        ("confluent-kafka consume", len(records) / consume_s),
    ]


def _confluent_produce(producer: Any, topic: str, records: list[tuple[bytes, bytes]]) -> None:
    for key, value in records:
        while True:
            try:
                producer.produce(topic, value, key)
                break
            except BufferError:  # its queue is full: let it deliver some
                producer.poll(0.01)


def kafka_perf_tools(broker: EmbeddedBroker, settings: Settings, records: int, size: int) -> list[tuple[str, float]]:
    """kafka-producer-perf-test and kafka-consumer-perf-test from the broker's own jars."""
    classpath = broker._classpath()
    topic = f"{settings.app}.perf"
    produced = subprocess.run(
        ["java", "-Xmx512m", "-cp", classpath, "org.apache.kafka.tools.ProducerPerformance",
         "--topic", topic, "--num-records", str(records), "--record-size", str(size), "--throughput", "-1",
         "--producer-props", f"bootstrap.servers={settings.bootstrap_servers}", "acks=all", "linger.ms=20"],
        capture_output=True, text=True, timeout=1200,
    )
    out: list[tuple[str, float]] = []
    match = re.search(r"records sent, ([\d.]+) records/sec", produced.stdout)
    if match:
        out.append(("kafka-producer-perf-test (acks=all)", float(match.group(1))))
    consumed = subprocess.run(
        ["java", "-Xmx512m", "-cp", classpath, "org.apache.kafka.tools.ConsumerPerformance",
         "--topic", topic, "--messages", str(records), "--bootstrap-server", settings.bootstrap_servers],
        capture_output=True, text=True, timeout=1200,
    )
    lines = [line for line in consumed.stdout.splitlines() if line and line[0].isdigit()]
    if lines:
        # start.time, end.time, data.consumed.in.MB, MB.sec, data.consumed.in.nMsg, nMsg.sec, ...
        fields = [f.strip() for f in lines[-1].split(",")]
        out.append(("kafka-consumer-perf-test", float(fields[5])))
    return out
