"""A state store held in memory, so that tasks and restores can be tested without RocksDB."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator, Mapping

from .store import StateStore


class InMemoryStore(StateStore):
    """The StateStore contract over a dict and its sorted keys. Nothing survives close().

    A write copies the whole store, which is fine at the sizes tests use."""

    def __init__(self) -> None:
        self._values: dict[bytes, bytes] = {}
        self._keys: list[bytes] = []  # the keys of _values, sorted so that scan can bisect
        self._offsets: dict[int, int] = {}
        self._closed = False

    def get(self, key: bytes) -> bytes | None:
        self._check_open()
        return self._values.get(key)

    def get_many(self, keys: list[bytes]) -> dict[bytes, bytes | None]:
        self._check_open()
        return {key: self._values.get(key) for key in keys}

    def changelog_offsets(self) -> dict[int, int]:
        self._check_open()
        return dict(self._offsets)

    def write(self, updates: Mapping[bytes, bytes | None], offsets: Mapping[int, int]) -> None:
        self._check_open()
        # Build new maps and swap them in: a write that fails part-way (sorting a key that
        # is not bytes) changes nothing, and a scan under way keeps the view it started with,
        # as a RocksDB batch and iterator do.
        values = dict(self._values)
        for key, value in updates.items():
            if value is None:
                values.pop(key, None)
            else:
                values[key] = value
        keys = sorted(values)
        self._values, self._keys, self._offsets = values, keys, self._offsets | dict(offsets)

    def scan(self, start: bytes, end: bytes) -> Iterator[tuple[bytes, bytes]]:
        self._check_open()
        keys, values = self._keys, self._values
        for i in range(bisect_left(keys, start), bisect_left(keys, end)):
            yield keys[i], values[keys[i]]

    def close(self) -> None:
        self._closed = True
        self._values, self._keys, self._offsets = {}, [], {}

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the state store is closed")
