"""Generations readers left are removed once no read can be using them (catalog.Tables.retire):
a rebuild no longer doubles a read model's disk for good. Pure: no Kafka, no Spark."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from esk.projections.catalog import Tables

HOLDER = """
import sys, time
from pathlib import Path
from esk.projections.run_lock import GenerationLock
GenerationLock(Path(sys.argv[1]), "totals", 2).acquire()
print("held", flush=True)
time.sleep(600)
"""


def _generation(tables: Tables, generation: int) -> None:
    """What a run leaves of a generation: its table (a Delta log in it), its checkpoint, its lock."""
    (tables.path("totals", generation) / "_delta_log").mkdir(parents=True)
    (tables.path("totals", generation) / "_delta_log" / "00000000000000000000.json").write_text("{}")
    (tables.checkpoint("totals", generation) / "offsets").mkdir(parents=True)
    lock = tables.run_lock("totals", generation)
    lock.acquire()
    lock.release()


def _switched_ago(tables: Tables, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(tables.warehouse / "totals" / "CURRENT", (then, then))


def test_generations_readers_left_go_once_they_have_been_left_long_enough(tmp_path: Path) -> None:
    tables = Tables(tmp_path)
    for generation in (1, 2, 3, 4):  # 4: a rebuild on its way, readers not switched yet
        _generation(tables, generation)
    (tables.warehouse / "_checkpoints" / "totals" / "g5.lock").touch()  # a lock alone
    tables.switch("totals", 3)
    assert tables.generations("totals") == [1, 2, 3, 4, 5]
    assert tables.retire("totals", unused_for_s=600) == []  # just switched: a read may still use g2
    _switched_ago(tables, 601)
    assert tables.retire("totals", unused_for_s=600) == [1, 2]
    assert tables.generations("totals") == [3, 4, 5]
    for generation in (1, 2):
        assert not tables.path("totals", generation).exists() and not tables.checkpoint("totals", generation).exists()
        assert not tables.run_lock("totals", generation).path.exists()
    for generation in (3, 4):
        assert (tables.path("totals", generation) / "_delta_log").is_dir() and tables.checkpoint("totals", generation).is_dir()
    assert tables.current_generation("totals") == 3
    assert tables.retire("totals", unused_for_s=600) == []
    assert tables.retire("never-built", unused_for_s=0) == []


def test_a_generation_a_run_still_keeps_stays_until_it_lets_go(tmp_path: Path) -> None:
    tables = Tables(tmp_path)
    for generation in (1, 2):
        _generation(tables, generation)
    tables.switch("totals", 2)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tables.run_lock("totals", 1).path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        assert tables.retire("totals", unused_for_s=0) == []  # a run about to follow readers
        assert tables.path("totals", 1).is_dir()
    finally:
        holder.kill()
        holder.wait()
    assert tables.retire("totals", unused_for_s=0) == [1]
    assert tables.generations("totals") == [2]
