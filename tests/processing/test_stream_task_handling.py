"""StreamTask without a broker: what one batch of commands becomes (outputs and store
writes), read-your-writes through the overlay, and a store written only once a batch's
transaction is reported committed. The store is the in-memory one; the contract tests
(tests/state) hold it to the same behaviour as RocksDB."""

from __future__ import annotations

import dataclasses
from datetime import timedelta

import orjson
from aiokafka import TopicPartition

from domain import AGGREGATES
from domain.accounts import accounts
from esk.kafka.topics import TopicNames
from esk.processing.stream_task import Batch, StreamTask
from esk.protocol import CommandEnvelope, Outcome, StoredAggregate, aggregate_key, command_key, position_key
from esk.registry import Registry
from esk.state.memory import InMemoryStore
from tests.system import command_record

TOPICS = TopicNames("unit")
REGISTRY: Registry = {t.name: t for t in AGGREGATES}
PARTITION = 2


def _task(registry: Registry = REGISTRY, store: InMemoryStore | None = None) -> StreamTask:
    return StreamTask(PARTITION, TOPICS, registry, store or InMemoryStore(), 0, dedup_window_ms=60_000)


def _feed(task: StreamTask, *envelopes: CommandEnvelope) -> None:
    task.process([command_record(TOPICS.commands, task.next_offset + n, e, PARTITION) for n, e in enumerate(envelopes)])


def _commit(task: StreamTask) -> Batch:
    """What the TaskManager does once the transaction is in: the changelog's last offset is
    the number of changelog records, as if the topic had been empty."""
    batch = task.seal()
    changelog = [o for o in batch.outputs if o.topic == TOPICS.changelog]
    task.committed(batch, {TopicPartition(TOPICS.changelog, PARTITION): len(changelog) - 1})
    return batch


def _outcomes(batch: Batch) -> list[Outcome]:
    return [Outcome.decode(o.value) for o in batch.outputs if o.topic == TOPICS.results and o.value is not None]


def _version(task: StreamTask, aggregate_id: str) -> int | None:
    raw = task.store.get(aggregate_key("accounts", aggregate_id))
    return StoredAggregate.decode(raw).version if raw is not None else None


def open_(aggregate_id: str, command_id: str = "") -> CommandEnvelope:
    return CommandEnvelope(command_id or f"open-{aggregate_id}", "accounts", aggregate_id, "open", {"owner": "ada"})


def deposit(aggregate_id: str, command_id: str, amount: int = 5, expected_version: int | None = None) -> CommandEnvelope:
    return CommandEnvelope(command_id, "accounts", aggregate_id, "deposit", {"amount": amount}, expected_version=expected_version)


def test_an_accepted_command_becomes_events_an_outcome_and_changelog_records_in_its_batch() -> None:
    task = _task()
    _feed(task, open_("a1"))
    assert task.store.get(aggregate_key("accounts", "a1")) is None  # nothing in the store before the commit
    batch = task.seal()
    by_topic = {topic: [o for o in batch.outputs if o.topic == topic] for topic in {o.topic for o in batch.outputs}}
    [event] = by_topic[TOPICS.events("accounts")]
    assert orjson.loads(event.value or b"")["type"] == "Opened" and event.key == b"a1" and event.partition is None
    assert dict(event.headers or [])["esk-event-type"] == b"Opened"
    [outcome] = _outcomes(batch)
    assert (outcome.status, outcome.version, outcome.command_id) == ("accepted", 1, "open-a1")
    changelog_keys = [o.key for o in by_topic[TOPICS.changelog]]
    # the aggregate, the de-duplication entry, and the position, all on the task's own partition
    assert changelog_keys == [aggregate_key("accounts", "a1"), command_key("open-a1"), position_key(PARTITION)]
    assert {o.partition for o in by_topic[TOPICS.changelog]} == {PARTITION}
    assert batch.end_offset == 1 and batch.writes[position_key(PARTITION)] == b"1"


def test_the_store_is_written_with_its_changelog_offset_only_when_the_batch_is_committed() -> None:
    task = _task()
    _feed(task, open_("a1"))
    batch = task.seal()
    assert task.store.changelog_offsets() == {} and _version(task, "a1") is None
    task.committed(batch, {TopicPartition(TOPICS.changelog, PARTITION): 41})
    assert _version(task, "a1") == 1
    assert task.store.changelog_offsets() == {PARTITION: 42}
    assert task.store.get(position_key(PARTITION)) == b"1" and task.committed_offset == 1


def test_commands_handled_while_a_batch_is_sealed_read_its_writes() -> None:
    task = _task()
    _feed(task, open_("a1"))
    task.seal()  # its transaction is in flight
    _feed(task, deposit("a1", "d1"))
    [outcome] = _outcomes(task.seal())
    assert (outcome.status, outcome.version) == ("accepted", 2)
    assert _version(task, "a1") is None  # neither batch is committed


def test_a_retried_command_answers_with_its_first_outcome_and_emits_no_event() -> None:
    task = _task()
    _feed(task, open_("a1"), deposit("a1", "d1"))
    _commit(task)
    _feed(task, deposit("a1", "d1", amount=999))  # same command id: a retry
    batch = _commit(task)
    [outcome] = _outcomes(batch)
    assert (outcome.command_id, outcome.version) == ("d1", 2)
    assert not [o for o in batch.outputs if o.topic == TOPICS.events("accounts")]
    assert _version(task, "a1") == 2


def test_an_expected_version_that_differs_is_refused_and_changes_nothing() -> None:
    task = _task()
    _feed(task, open_("a1"))
    _commit(task)
    _feed(task, deposit("a1", "d1", expected_version=7))
    batch = _commit(task)
    [outcome] = _outcomes(batch)
    assert (outcome.status, outcome.version) == ("precondition_failed", 1)
    assert _version(task, "a1") == 1


def test_a_payload_the_command_no_longer_takes_is_rejected_in_a_line() -> None:
    """A command queued before a release changed its body (the API checks new ones)."""
    task = _task()
    _feed(task, open_("a1"))
    _commit(task)
    _feed(task, CommandEnvelope("d1", "accounts", "a1", "deposit", {"amount": "lots", "memo": "old field"}))
    [outcome] = _outcomes(_commit(task))
    assert (outcome.status, outcome.code, outcome.version) == ("rejected", "invalid_payload", 1)
    assert outcome.detail == (
        "the deposit payload is invalid: amount: Input should be a valid integer, unable to parse string as an integer; "
        "memo: Extra inputs are not permitted"
    ), outcome.detail


def test_undecodable_records_and_misplaced_keys_go_to_the_dead_letter_queue() -> None:
    task = _task()
    garbage = command_record(TOPICS.commands, 0, open_("a1"), PARTITION)
    garbage = dataclasses.replace(garbage, value=b"{not json")
    misplaced = dataclasses.replace(command_record(TOPICS.commands, 1, open_("a2"), PARTITION), key=b"someone-else")
    task.process([garbage, misplaced])
    batch = task.seal()
    dead = [o for o in batch.outputs if o.topic == TOPICS.dlq]
    assert [dict(o.headers or [])["esk-dlq-offset"] for o in dead] == [b"0", b"1"]
    assert b"not JSON" in dict(dead[0].headers or [])["esk-dlq-reason"]
    assert batch.end_offset == 2 and not _outcomes(batch)  # both passed over, neither handled


def test_records_fetched_again_after_a_rewind_are_not_handled_twice() -> None:
    task = _task()
    _feed(task, open_("a1"))
    task.process([command_record(TOPICS.commands, 0, open_("a1"), PARTITION)])
    assert len(_outcomes(task.seal())) == 1


def test_a_final_aggregate_expires_into_a_tombstone_after_its_retention() -> None:
    registry = {**REGISTRY, "accounts": dataclasses.replace(accounts, retention=timedelta(milliseconds=1))}
    task = _task(registry)
    _feed(task, open_("a1"), CommandEnvelope("c1", "accounts", "a1", "close", {}))
    _commit(task)
    assert _version(task, "a1") == 2
    expired = task.expire(now=2**50, limit=10)  # far in the future: the account and both de-dup entries
    assert expired == 3
    batch = _commit(task)
    tombstones = {o.key for o in batch.outputs if o.topic == TOPICS.changelog and o.value is None}
    assert tombstones == {aggregate_key("accounts", "a1"), command_key("open-a1"), command_key("c1")}
    assert _version(task, "a1") is None
