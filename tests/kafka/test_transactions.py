"""StreamsProducer against the real broker: a commit in numbered steps, and a failed one
aborted at once (not left open until the transaction times out)."""

from __future__ import annotations

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import KafkaError

from esk.kafka.reader import committed_reader, read_committed
from esk.kafka.topics import TopicSpec, ensure_topics
from esk.processing.record_collector import Output
from esk.processing.streams_producer import StreamsProducer
from esk.settings import Settings
from tests.system import wait_for

pytestmark = pytest.mark.kafka


async def _topic(settings: Settings) -> str:
    topic = f"{settings.app}.txn"
    report = await ensure_topics(settings, [TopicSpec(topic, 1, 1, {})])
    assert not report.problems
    return topic


async def test_a_commit_writes_every_record_in_one_transaction(settings: Settings) -> None:
    topic = await _topic(settings)
    producer = StreamsProducer(settings, f"{settings.app}.0", "test")
    await producer.start()
    try:
        written = await producer.commit([Output(topic, b"k", b"%d" % n) for n in range(5)], None, "")
    finally:
        await producer.stop()
    assert written == {TopicPartition(topic, 0): 4}
    await _committed(settings, topic, [b"0", b"1", b"2", b"3", b"4"])


async def test_a_failed_commit_is_aborted_at_once(settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    """Step 4 fails after the records were written: the transaction is aborted explicitly,
    so read_committed readers see the partition's end move past it straight away (an open
    transaction would hold the last stable offset back for transaction_timeout_ms)."""
    topic = await _topic(settings)
    tp = TopicPartition(topic, 0)
    producer = StreamsProducer(settings, f"{settings.app}.0", "test")
    await producer.start()
    reader = committed_reader(settings)
    await reader.start()
    try:
        async def refused() -> None:
            raise KafkaError("refused at step 4")

        monkeypatch.setattr(producer._producer, "commit_transaction", refused)
        with pytest.raises(KafkaError, match="step 4"):
            await producer.commit([Output(topic, b"k", b"lost")], None, "")
        # records at 0, the abort marker at 1: the last stable offset is past both, within
        # the moment the coordinator takes to write the marker after it answered
        await wait_for(lambda: _end_offset(reader, tp, 2), timeout_s=10, what="the abort marker")
        monkeypatch.undo()
        await producer.commit([Output(topic, b"k", b"kept")], None, "")
    finally:
        await reader.stop()
        await producer.stop()
    await _committed(settings, topic, [b"kept"])


async def _committed(settings: Settings, topic: str, values: list[bytes]) -> None:
    """read_committed reads `values`, once the commit's marker is there: the coordinator
    answers a commit before the partition has its marker (a few milliseconds later)."""

    async def read() -> bool:
        return [r.value for r in await read_committed(settings, topic)] == values

    await wait_for(read, timeout_s=10, what=f"{values} committed")


async def _end_offset(reader: AIOKafkaConsumer, tp: TopicPartition, offset: int) -> bool:
    return bool((await reader.end_offsets([tp]))[tp] == offset)
