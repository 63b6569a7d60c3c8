"""The StateStore contract, one set of tests run against every implementation."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import pytest
from aiokafka import TopicPartition
from aiokafka.structs import ConsumerRecord

from esk.protocol import EXPIRY_PREFIX, expires_at_header, expiry_key
from esk.state.memory import InMemoryStore
from esk.state.resources import StoreResources
from esk.state.restore import changelog_updates
from esk.state.store import RocksDBStore, StateStore


class Backend:
    """Opens stores of one implementation and closes whatever a test leaves open."""

    def __init__(self, open_store: Callable[[], StateStore], durable: bool) -> None:
        self._open_store = open_store
        self.durable = durable  # whether a store opened again holds what the closed one had
        self._opened: list[StateStore] = []

    def open(self) -> StateStore:
        store = self._open_store()
        self._opened.append(store)
        return store

    def close_all(self) -> None:
        for store in self._opened:
            store.close()


@pytest.fixture(params=["rocksdb", "memory"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    if request.param == "rocksdb":
        resources = StoreResources(16)
        chosen = Backend(lambda: RocksDBStore(tmp_path / "store", resources), durable=True)
    else:
        chosen = Backend(InMemoryStore, durable=False)
    yield chosen
    chosen.close_all()


@pytest.fixture
def store(backend: Backend) -> StateStore:
    return backend.open()


def test_get_of_an_absent_key_is_none(store: StateStore) -> None:
    store.write({b"a": b"1"}, {})
    assert store.get(b"b") is None


def test_put_then_get(store: StateStore) -> None:
    store.write({b"a": b"1", b"b": b"2"}, {})
    assert (store.get(b"a"), store.get(b"b")) == (b"1", b"2")


def test_a_later_write_replaces_the_value(store: StateStore) -> None:
    store.write({b"a": b"1"}, {})
    store.write({b"a": b"2"}, {})
    assert store.get(b"a") == b"2"


def test_an_empty_value_is_a_value_not_a_delete(store: StateStore) -> None:
    store.write({b"a": b""}, {})
    assert store.get(b"a") == b""
    assert store.get_many([b"a"]) == {b"a": b""}
    assert list(store.scan(b"a", b"b")) == [(b"a", b"")]


def test_none_deletes(store: StateStore) -> None:
    store.write({b"a": b"1", b"b": b"2"}, {})
    store.write({b"a": None}, {})
    assert store.get(b"a") is None
    assert list(store.scan(b"", b"\xff")) == [(b"b", b"2")]


def test_deleting_an_absent_key_changes_nothing(store: StateStore) -> None:
    store.write({b"a": b"1"}, {})
    store.write({b"b": None}, {})
    assert list(store.scan(b"", b"\xff")) == [(b"a", b"1")]


def test_get_many_mixes_present_and_absent_keys(store: StateStore) -> None:
    store.write({b"a": b"1", b"c": b"3"}, {})
    assert store.get_many([b"c", b"b", b"a"]) == {b"c": b"3", b"b": None, b"a": b"1"}


def test_get_many_of_no_keys_is_empty(store: StateStore) -> None:
    store.write({b"a": b"1"}, {})
    assert store.get_many([]) == {}


def test_scan_includes_start_excludes_end_in_key_order(store: StateStore) -> None:
    store.write({b"d": b"4", b"b": b"2", b"a": b"1", b"c": b"3", b"e": b"5"}, {})
    assert list(store.scan(b"b", b"e")) == [(b"b", b"2"), (b"c", b"3"), (b"d", b"4")]


def test_scan_bounds_need_not_be_keys(store: StateStore) -> None:
    store.write({b"a": b"1", b"c": b"3", b"e": b"5"}, {})
    assert list(store.scan(b"b", b"d")) == [(b"c", b"3")]


def test_scan_orders_keys_that_share_a_prefix_bytewise(store: StateStore) -> None:
    keys = [b"x/", b"x/1", b"x/10", b"x/2", b"x/1\x00", b"x0", b"x/\xff"]
    store.write({key: key for key in keys}, {})
    # The end b"x0" is the first key after every b"x/..." (ord("0") == ord("/") + 1).
    assert [key for key, _ in store.scan(b"x/", b"x0")] == [b"x/", b"x/1", b"x/1\x00", b"x/10", b"x/2", b"x/\xff"]
    assert [key for key, _ in store.scan(b"x/1", b"x/10")] == [b"x/1", b"x/1\x00"]


@pytest.mark.parametrize(
    ("start", "end"), [(b"b", b"b"), (b"c", b"b"), (b"f", b"z")], ids=["equal", "reversed", "beyond"]
)
def test_scan_of_an_empty_range_yields_nothing(store: StateStore, start: bytes, end: bytes) -> None:
    store.write({b"a": b"1", b"b": b"2", b"c": b"3"}, {})
    assert list(store.scan(start, end)) == []


def test_scan_sees_the_store_as_it_was_when_iteration_began(store: StateStore) -> None:
    # The expiry sweep deletes while it scans: that must neither skip nor break the scan.
    store.write({b"a": b"1", b"c": b"3"}, {})
    entries = store.scan(b"", b"\xff")
    assert next(entries) == (b"a", b"1")
    store.write({b"b": b"2", b"c": None}, {})
    assert list(entries) == [(b"c", b"3")]


def test_no_offsets_until_written(store: StateStore) -> None:
    assert store.changelog_offsets() == {}


def test_offsets_are_recorded_with_the_data(store: StateStore) -> None:
    store.write({b"a": b"1"}, {0: 7, 2: 3})
    assert store.changelog_offsets() == {0: 7, 2: 3}
    assert store.get(b"a") == b"1"


def test_offsets_are_replaced_per_partition(store: StateStore) -> None:
    # Partitions 1 and 10 share a prefix in RocksDB's meta keys; writing one must not touch the other.
    store.write({}, {1: 5, 10: 50, 2: 20})
    store.write({}, {1: 6})
    store.write({}, {10: 51})
    assert store.changelog_offsets() == {1: 6, 10: 51, 2: 20}


def test_offsets_are_not_in_the_data(store: StateStore) -> None:
    store.write({b"a": b"1"}, {0: 7})
    assert list(store.scan(b"", b"\xff" * 32)) == [(b"a", b"1")]


def test_a_write_of_offsets_only_keeps_the_data(store: StateStore) -> None:
    store.write({b"a": b"1"}, {0: 1})
    store.write({}, {0: 9})
    assert store.changelog_offsets() == {0: 9}
    assert store.get(b"a") == b"1"


def test_a_write_that_raises_applies_nothing(store: StateStore) -> None:
    store.write({b"a": b"1"}, {0: 1})
    bad_key = cast(bytes, "not bytes")
    with pytest.raises(Exception):  # noqa: B017 - each implementation raises its own error
        store.write({b"a": b"2", b"b": b"2", bad_key: b"3"}, {0: 2})
    assert store.get_many([b"a", b"b"]) == {b"a": b"1", b"b": None}
    assert store.changelog_offsets() == {0: 1}


def test_data_and_offsets_survive_close_and_reopen(backend: Backend) -> None:
    if not backend.durable:
        pytest.skip("an in-memory store keeps nothing once closed")
    store = backend.open()
    store.write({b"a": b"1", b"b": b"2"}, {0: 7, 1: 3})
    store.write({b"b": None}, {1: 4})
    store.close()
    reopened = backend.open()
    assert list(reopened.scan(b"", b"\xff")) == [(b"a", b"1")]
    assert reopened.changelog_offsets() == {0: 7, 1: 4}


_USES: dict[str, Callable[[StateStore], Any]] = {
    "get": lambda s: s.get(b"a"),
    "get_many": lambda s: s.get_many([b"a"]),
    "changelog_offsets": lambda s: s.changelog_offsets(),
    "write": lambda s: s.write({b"b": b"2"}, {0: 1}),
    "scan": lambda s: list(s.scan(b"", b"\xff")),
}


@pytest.mark.parametrize("use", _USES.values(), ids=_USES.keys())
def test_use_after_close_raises(store: StateStore, use: Callable[[StateStore], Any]) -> None:
    store.write({b"a": b"1"}, {})
    use(store)  # works while open, so the error below comes from closing
    store.close()
    with pytest.raises(Exception):  # noqa: B017 - RocksDBStore raises AssertionError, InMemoryStore RuntimeError
        use(store)


def test_closing_twice_is_harmless(store: StateStore) -> None:
    store.close()
    store.close()


def _record(
    partition: int, offset: int, key: bytes | None, value: bytes | None, expires_at: int | None = None
) -> ConsumerRecord[bytes, bytes]:
    # aiokafka types key and value as the deserialised types, but keyless records and tombstones carry None.
    return ConsumerRecord(
        topic="changelog",
        partition=partition,
        offset=offset,
        timestamp=0,
        timestamp_type=0,
        key=cast(bytes, key),
        value=cast(bytes, value),
        checksum=None,
        serialized_key_size=0,
        serialized_value_size=0,
        headers=[expires_at_header(expires_at)] if expires_at is not None else [],
    )


def test_a_batch_of_changelog_records_restores_into_the_store(store: StateStore) -> None:
    store.write({b"gone": b"old", b"kept": b"old"}, {0: 0, 1: 0})
    batches = {
        TopicPartition("changelog", 0): [
            _record(0, 0, b"a", b"1"),
            _record(0, 1, b"a", b"2", expires_at=1_000),
            _record(0, 2, None, b"keyless, so skipped"),
        ],
        TopicPartition("changelog", 1): [_record(1, 0, b"gone", None), _record(1, 1, b"b", b"3")],
    }
    store.write(changelog_updates(batches, expiry_index=True), {0: 3, 1: 2})
    assert list(store.scan(b"", EXPIRY_PREFIX)) == [(b"a", b"2"), (b"b", b"3"), (b"kept", b"old")]
    assert list(store.scan(EXPIRY_PREFIX, EXPIRY_PREFIX + b"\xff")) == [(expiry_key(1_000, b"a"), b"")]
    assert store.changelog_offsets() == {0: 3, 1: 2}


@pytest.mark.parametrize(
    ("values", "expected"),
    [((b"2", None), None), ((None, b"2"), b"2"), ((b"2", b"3"), b"3")],
    ids=["put-delete", "delete-put", "put-put"],
)
def test_the_last_record_of_a_key_in_a_batch_wins(
    store: StateStore, values: tuple[bytes | None, bytes | None], expected: bytes | None
) -> None:
    # One Mapping cannot hold two writes of a key, so the batch that can is a changelog batch.
    store.write({b"a": b"1"}, {})
    first, last = values
    batches = {TopicPartition("changelog", 0): [_record(0, 0, b"a", first), _record(0, 1, b"a", last)]}
    store.write(changelog_updates(batches), {0: 2})
    assert store.get(b"a") == expected
