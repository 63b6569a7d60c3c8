"""Overlay: a task's store writes that are not in its store yet, layered over the store.

Two layers: the open batch's writes, and those of the sealed batch whose transaction is in
flight. Reads look in the open layer, then the sealed one, then the values fetched ahead
for the records in hand, then the store. RocksDB is written only once a transaction has
committed (Quix Streams does the same): a crash or an abort leaves the store untouched.
"""

from __future__ import annotations

from typing import Final, cast

from ..state.store import StateStore

# Not in a layer (a None there means deleted).
ABSENT: Final = object()

Writes = dict[bytes, bytes | None]  # None deletes


class Overlay:
    def __init__(self, store: StateStore) -> None:
        self.store = store
        self.open: Writes = {}
        self.sealed: Writes | None = None
        self._fetched: Writes = {}

    def pending(self, key: bytes) -> object:
        """The key's latest write not yet in the store, or ABSENT."""
        value = self.open.get(key, ABSENT)
        if value is ABSENT and self.sealed is not None:
            value = self.sealed.get(key, ABSENT)
        return value

    def get(self, key: bytes) -> bytes | None:
        value = self.pending(key)
        if value is ABSENT:
            value = self._fetched.get(key, ABSENT)
        return self.store.get(key) if value is ABSENT else cast("bytes | None", value)

    def fetch(self, keys: list[bytes]) -> None:
        """Read ahead, in one multi-get, what the store holds for the keys no layer has.
        The values stay true until `forget_fetched`: the store is written only after a
        commit, and a commit runs only when the handling gives the event loop a turn."""
        self._fetched = self.store.get_many([key for key in keys if self.pending(key) is ABSENT])

    def forget_fetched(self) -> None:
        self._fetched = {}

    def put(self, key: bytes, value: bytes | None) -> None:
        self.open[key] = value

    def seal(self) -> Writes:
        """The open layer becomes the sealed one (its transaction is about to begin)."""
        self.sealed, self.open = self.open, {}
        return self.sealed

    def release(self) -> None:
        """The sealed layer is in the store now, or will never be (the task fails)."""
        self.sealed = None
