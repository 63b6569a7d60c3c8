"""Which stores of a processor's state directory go, and when: pure logic over real
directories (and a real RocksDB lock held by another process), no Kafka."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from rocksdict import Rdict

from esk.state.directory import StateDirectory
from esk.state.resources import StoreResources
from esk.state.store import CHECKPOINT, RocksDBStore


def _directory(root: Path, partitions: range) -> StateDirectory:
    directory = StateDirectory(root, "shop.commands")
    for partition in partitions:
        Rdict(str(directory.store_path(partition))).close()
    return directory


def test_a_store_goes_once_unused_at_every_look_for_the_delay(tmp_path: Path) -> None:
    directory = _directory(tmp_path, range(3))
    assert directory.set_aside_unused({0}, delay_s=10, now=100) == {}
    assert directory.set_aside_unused({0, 1}, delay_s=10, now=105) == {}  # 1 in use again: its wait starts over
    aside = directory.set_aside_unused({0}, delay_s=10, now=110)
    assert list(aside) == [2]
    assert directory.partitions_on_disk() == {0, 1}
    assert directory.set_aside_earlier() == [aside[2]]  # until deleted
    assert directory.set_aside_unused({0}, delay_s=10, now=119) == {}
    assert list(directory.set_aside_unused({0}, delay_s=10, now=120)) == [1]
    directory.delete(directory.set_aside_earlier())
    assert directory.set_aside_earlier() == [] and directory.partitions_on_disk() == {0}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shop.commands-0"]


def test_a_store_another_process_holds_open_stays(tmp_path: Path) -> None:
    """Two processors may share a directory: a store the other one has open is its own."""
    directory = _directory(tmp_path, range(2))
    holder = subprocess.Popen(
        [sys.executable, "-c", f"from rocksdict import Rdict; import sys, time; d = Rdict({str(directory.store_path(1))!r}); print('open', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "open\n"
        assert directory.set_aside_unused(set(), delay_s=0, now=time.monotonic()).keys() == {0}
        assert directory.partitions_on_disk() == {1}
    finally:
        holder.kill()
        holder.wait()
    assert directory.set_aside_unused(set(), delay_s=0, now=time.monotonic()).keys() == {1}


def test_a_store_this_process_has_open_never_goes_and_a_use_starts_the_wait_over(tmp_path: Path) -> None:
    """RocksDB's lock does not tell a store of this process's own: it is never set aside,
    whatever the caller says is in use (a lock test on it would drop RocksDB's lock)."""
    directory = _directory(tmp_path, range(3))
    store = RocksDBStore(directory.store_path(0), StoreResources(16))
    try:
        assert directory.set_aside_unused(set(), delay_s=10, now=0) == {}
        directory.mark_used({1})  # given to this process between two looks
        assert directory.set_aside_unused(set(), delay_s=10, now=10).keys() == {2}
        assert directory.partitions_on_disk() == {0, 1}
        store.write({b"k": b"v"}, {})  # still its own
    finally:
        store.close()
    assert directory.set_aside_unused(set(), delay_s=10, now=20).keys() == {0, 1}


def test_how_warm_a_copy_on_disk_is_is_read_without_opening_it(tmp_path: Path) -> None:
    """What a processor tells the group's leader as it joins: the offsets each store held at
    its last clean close. A store that never closed cleanly (killed while open, say) reads
    as cold; one that did reads as it was, whatever happened to it after."""
    directory = _directory(tmp_path, range(1))  # made by RocksDB alone: never closed by esk
    for partition, offset in ((1, 40), (2, 7)):
        store = RocksDBStore(directory.store_path(partition), StoreResources(16))
        store.write({b"k": b"v"}, {partition: offset})
        store.close()
    assert directory.copies_on_disk() == {0: 0, 1: 40, 2: 7}

    store = RocksDBStore(directory.store_path(2), StoreResources(16))  # reopened: its data and offsets as they were
    assert store.get(b"k") == b"v" and store.changelog_offsets() == {2: 7}
    store.write({}, {2: 90})
    assert directory.copies_on_disk()[2] == 7  # while open: its last close's
    store.close()
    assert directory.copies_on_disk()[2] == 90

    (directory.store_path(1) / CHECKPOINT).write_text("{not json")
    assert directory.copies_on_disk()[1] == 0
