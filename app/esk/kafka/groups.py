"""Consumer groups from the outside: who is in one, what it committed, and moving its
offsets while nobody is in it (what `kafka-consumer-groups --reset-offsets` does); and the
offsets of partitions (beginning, end, by time), as read_committed readers see them."""

from __future__ import annotations

from collections.abc import Iterable

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

from ..settings import Settings
from .admin import retry_while_brokers_fail
from .client_options import client_options
from .metadata import topic_partitions
from .reader import committed_reader
from .stopping import stop_consumer


async def group_members(settings: Settings, group_id: str) -> list[str]:
    """The members of a group now, as `client_id@host`."""
    admin = AIOKafkaAdminClient(**client_options(settings))
    await admin.start()
    try:
        members: list[str] = []
        for response in await retry_while_brokers_fail(lambda: admin.describe_consumer_groups([group_id])):
            for _error, _group, _state, _protocol_type, _protocol, group_members, *_ in response.groups:
                members.extend(f"{client_id}@{host.lstrip('/')}" for _member, client_id, host, *_ in group_members)
        return members
    finally:
        await admin.close()


async def committed_offsets(settings: Settings, group_id: str) -> dict[TopicPartition, int]:
    """What the group committed, for every partition it has an offset of."""
    admin = AIOKafkaAdminClient(**client_options(settings))
    await admin.start()
    try:
        offsets = await retry_while_brokers_fail(lambda: admin.list_consumer_group_offsets(group_id))
        return {tp: meta.offset for tp, meta in offsets.items() if meta.offset >= 0}
    finally:
        await admin.close()


async def commit_offsets_of_empty_group(settings: Settings, group_id: str, offsets: dict[TopicPartition, int]) -> None:
    """Commit `offsets` for a group that has no member (the broker refuses it otherwise)."""
    consumer = AIOKafkaConsumer(**client_options(settings), group_id=group_id, enable_auto_commit=False)
    await consumer.start()
    try:
        consumer.assign(list(offsets))
        await consumer.commit(dict(offsets))
    finally:
        await stop_consumer(consumer)


async def all_partitions(settings: Settings, topics: Iterable[str]) -> list[TopicPartition]:
    return [TopicPartition(topic, p) for topic in topics for p in await topic_partitions(settings, topic)]


async def partition_offsets(
    settings: Settings, tps: list[TopicPartition], at_ms: int | None = None
) -> tuple[dict[TopicPartition, int], dict[TopicPartition, int], dict[TopicPartition, int]]:
    """(beginning, end, at) offsets of each partition: end is the last stable offset (what a
    read_committed reader reaches); `at`, when `at_ms` is given, the first offset whose
    record is at or after that time (the end where there is none)."""
    consumer = committed_reader(settings)
    await consumer.start()
    try:
        beginning = await consumer.beginning_offsets(tps)
        end = await consumer.end_offsets(tps)
        at: dict[TopicPartition, int] = {}
        if at_ms is not None:
            found = await consumer.offsets_for_times(dict.fromkeys(tps, at_ms))
            at = {tp: found[tp].offset if found.get(tp) is not None else end[tp] for tp in tps}
        return beginning, end, at
    finally:
        await stop_consumer(consumer)
