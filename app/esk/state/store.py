"""A key-value state store that remembers which changelog offsets its data reflects.

Data and the changelog offsets are written in ONE atomic batch, so after any crash the
store is a consistent snapshot of the changelog up to the offsets it records; restoring
resumes exactly there.

A store closed cleanly also leaves those offsets in a small file beside its data (its
checkpoint, as Kafka Streams keeps one per task): how warm a copy on disk is can then be
told without opening it, as a processor tells the group's leader when it joins. A store
that crashed keeps the checkpoint of its last clean close, which says no more than it
holds (its offsets only grow; a store wiped goes with its checkpoint).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import struct
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import cast

import orjson
from rocksdict import ColumnFamily, Rdict, WriteBatch

from .resources import StoreResources

log = logging.getLogger(__name__)

_OFFSET_PREFIX = b"changelog-offset/"
_META_CF = "meta"
CHECKPOINT = "esk.checkpoint"  # in the store's directory; RocksDB leaves files it does not know alone

# The stores this process has open, by resolved path: RocksDB's own lock does not tell
# them (a POSIX lock never conflicts with its own process), and the state directory's
# cleanup must never take one.
_OPEN: set[Path] = set()


def open_here(path: Path) -> bool:
    """Whether this process has the store at `path` open."""
    return path.resolve() in _OPEN


class StateStore(ABC):
    """Bytes keys to bytes values, and the changelog offsets that they reflect. After
    close(), every method raises (scan once iterated)."""

    @abstractmethod
    def get(self, key: bytes) -> bytes | None:
        """The value of `key`, None if absent (an empty value is b"", not None)."""

    @abstractmethod
    def get_many(self, keys: list[bytes]) -> dict[bytes, bytes | None]:
        """The values of `keys` (None where absent), read in one call."""

    @abstractmethod
    def changelog_offsets(self) -> dict[int, int]:
        """changelog partition -> next offset to apply, as last written for that partition."""

    @abstractmethod
    def write(self, updates: Mapping[bytes, bytes | None], offsets: Mapping[int, int]) -> None:
        """Apply puts (bytes) and deletes (None) and record the offsets, atomically: a
        write that raises applies nothing. Partitions not in `offsets` keep theirs."""

    @abstractmethod
    def scan(self, start: bytes, end: bytes) -> Iterator[tuple[bytes, bytes]]:
        """Entries with start <= key < end, in key order, as the store was when the
        iteration began."""

    @abstractmethod
    def close(self) -> None:
        """Release the store; closing it again does nothing."""


class RocksDBStore(StateStore):
    def __init__(self, path: Path, resources: StoreResources) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        options = resources.options()
        try:
            self._db: Rdict | None = Rdict(str(path), options, column_families={_META_CF: options})
        except Exception as error:
            if "lock" in str(error).lower():
                raise  # another live task owns it: never wipe a store in use
            # A corrupt store is rebuilt from the changelog rather than trusted or left blocking.
            log.warning("state store %s cannot be opened (%s); wiping it to restore from the changelog", path, error)
            shutil.rmtree(path, ignore_errors=True)
            self._db = Rdict(str(path), options, column_families={_META_CF: options})
        self._meta: Rdict | None = self._db.get_column_family(_META_CF)
        self._meta_handle: ColumnFamily | None = self._db.get_column_family_handle(_META_CF)
        _OPEN.add(path.resolve())

    # rocksdict's stubs type keys and values as any of the types it can store; in raw mode
    # (Options(raw_mode=True)) they are bytes, hence the casts.

    def get(self, key: bytes) -> bytes | None:
        assert self._db is not None
        return cast("bytes | None", self._db.get(key))

    def get_many(self, keys: list[bytes]) -> dict[bytes, bytes | None]:
        assert self._db is not None
        if not keys:
            return {}
        values = cast("list[bytes | None]", self._db.get(cast("list[str | int | float | bytes | bool]", keys)))
        return dict(zip(keys, values, strict=True))

    def changelog_offsets(self) -> dict[int, int]:
        assert self._meta is not None
        offsets: dict[int, int] = {}
        for key, value in cast("Iterator[tuple[bytes, bytes]]", self._meta.items(from_key=_OFFSET_PREFIX)):
            if not key.startswith(_OFFSET_PREFIX):
                break
            offsets[int(key[len(_OFFSET_PREFIX):])] = struct.unpack(">q", value)[0]
        return offsets

    def write(self, updates: Mapping[bytes, bytes | None], offsets: Mapping[int, int]) -> None:
        assert self._db is not None
        batch = WriteBatch(raw_mode=True)
        for key, value in updates.items():
            if value is None:
                batch.delete(key)
            else:
                batch.put(key, value)
        for partition, offset in offsets.items():
            batch.put(_OFFSET_PREFIX + str(partition).encode(), struct.pack(">q", offset), self._meta_handle)
        self._db.write(batch)

    def scan(self, start: bytes, end: bytes) -> Iterator[tuple[bytes, bytes]]:
        assert self._db is not None
        for key, value in cast("Iterator[tuple[bytes, bytes]]", self._db.items(from_key=start)):
            if key >= end:
                return
            yield key, value

    def close(self) -> None:
        offsets = self.changelog_offsets() if self._db is not None and self._meta is not None else None
        # Every handle holds the DB open; drop them all so the directory lock is released.
        if self._meta is not None:
            self._meta.close()
        if self._db is not None:
            self._db.close()
            _OPEN.discard(self.path.resolve())
        self._meta = self._db = None
        self._meta_handle = None
        if offsets is not None:
            _write_checkpoint(self.path, offsets)

    @staticmethod
    def destroy(path: Path) -> None:
        shutil.rmtree(path, ignore_errors=True)


def _write_checkpoint(path: Path, offsets: Mapping[int, int]) -> None:
    """Written whole or not at all (a rename): a reader never sees half of one."""
    partial = path / f"{CHECKPOINT}.{os.getpid()}.partial"
    try:
        partial.write_bytes(orjson.dumps({"changelog_offsets": {str(p): o for p, o in offsets.items()}}))
        os.replace(partial, path / CHECKPOINT)
    except OSError as error:  # a hint only: without it the copy reads as cold
        log.warning("could not write the checkpoint of state store %s: %s", path, error)
        with contextlib.suppress(OSError):
            partial.unlink()


def checkpointed_offsets(path: Path) -> dict[int, int]:
    """The changelog offsets the store at `path` held when it was last closed cleanly
    (changelog partition -> next offset to apply); empty when it never was, or the file
    cannot be read."""
    try:
        raw = orjson.loads((path / CHECKPOINT).read_bytes())
        return {int(p): int(o) for p, o in raw["changelog_offsets"].items()}
    except (OSError, orjson.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError):
        return {}


async def open_store(path: Path, resources: StoreResources) -> RocksDBStore:
    """Open a store, waiting while another task of this process still closes it (a
    partition that moves between a standby and an active task, or away and back)."""
    for attempt in range(50):
        try:
            return RocksDBStore(path, resources)
        except Exception as error:
            if "lock" not in str(error).lower() or attempt == 49:
                raise
            await asyncio.sleep(0.1)
    raise AssertionError("unreachable")
