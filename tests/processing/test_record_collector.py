"""RecordCollector against the real broker: keyed records land where aiokafka's own
`send` puts them, batches split when full, and the offsets it reports are the ones the
records got."""

from __future__ import annotations

import uuid

import pytest
from aiokafka import AIOKafkaProducer

from esk.kafka.client_options import client_options
from esk.kafka.reader import read_committed
from esk.kafka.topics import TopicSpec, ensure_topics
from esk.processing.record_collector import MAX_BATCH_BYTES, Output, RecordCollector
from esk.settings import Settings

pytestmark = pytest.mark.kafka


async def test_batches_land_where_send_would_put_them_with_the_offsets_reported(settings: Settings) -> None:
    batched, sent = f"{settings.app}.batched", f"{settings.app}.sent"
    await ensure_topics(settings, [TopicSpec(batched, 3, 1, {}), TopicSpec(sent, 3, 1, {})])
    keys = [f"k{n}-{uuid.uuid4().hex[:6]}".encode() for n in range(50)]
    value = b"v" * 1024  # 2,000 of these are several full batches per partition
    outputs = [Output(batched, keys[n % len(keys)], value + str(n).encode()) for n in range(2000)]
    outputs.append(Output(batched, None, b"placed", partition=2))
    assert sum(len(o.value or b"") for o in outputs) > 3 * MAX_BATCH_BYTES

    producer = AIOKafkaProducer(
        **client_options(settings), transactional_id=f"{settings.app}-collector", enable_idempotence=True,
        max_batch_size=MAX_BATCH_BYTES,
    )
    await producer.start()
    try:
        await producer.begin_transaction()
        last = await RecordCollector(producer).send(outputs)
        for key in keys:  # the same keys through aiokafka's per-record path
            await producer.send(sent, b"", key=key)
        await producer.commit_transaction()
    finally:
        await producer.stop()

    records = await read_committed(settings, batched)
    by_value = {r.value: r for r in records}
    assert len(records) == len(outputs)
    where_send_put = {r.key: r.partition for r in await read_committed(settings, sent)}
    for out in outputs:
        record = by_value[out.value]
        assert record.partition == (out.partition if out.key is None else where_send_put[out.key])
    for tp, offset in last.items():
        assert offset == max(r.offset for r in records if r.partition == tp.partition)
    # per partition, the records keep the order they were given in
    for partition in range(3):
        given = [o.value for o in outputs if by_value[o.value].partition == partition]
        assert [r.value for r in sorted(records, key=lambda r: r.offset) if r.partition == partition] == given
