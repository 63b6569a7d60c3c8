"""One run at a time per read model generation (projections/run_lock.py): a second run is
refused before its driver starts, naming the first; a run that dies, however it dies,
leaves no lock behind. Pure: no Kafka, no Spark."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from esk.projections.catalog import Tables
from esk.projections.run_lock import GenerationBusy, GenerationLock

# A process that takes the lock, says so, and holds it until it is killed
HOLDER = """
import sys, time
from pathlib import Path
from esk.projections.run_lock import GenerationLock
GenerationLock(Path(sys.argv[1]), "totals", 3).acquire()
print("held", flush=True)
time.sleep(600)
"""


@contextmanager
def _held_elsewhere(path: Path) -> Iterator[subprocess.Popen[str]]:
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(path), "--continuous"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        yield holder
    finally:
        if holder.poll() is None:
            holder.kill()
        holder.wait()


def test_a_second_run_is_refused_naming_the_first_and_a_killed_one_leaves_no_lock(tmp_path: Path) -> None:
    path = tmp_path / "_checkpoints" / "totals" / "g3.lock"
    with _held_elsewhere(path) as holder:
        with pytest.raises(GenerationBusy) as refused:
            GenerationLock(path, "totals", 3).acquire()
        message = str(refused.value)
        assert f"generation 3 is being run by another process (pid {holder.pid} on " in message
        assert "-c " in message and "--continuous" in message  # the holder's command line
        assert "stop that one first, or leave totals to it" in message
        holder.send_signal(signal.SIGKILL)  # no chance to release it: the kernel does
        holder.wait()
        lock = GenerationLock(path, "totals", 3)
        assert lock.acquire()
        with lock:
            assert lock.held
        assert not lock.held


def test_a_waiting_run_takes_the_lock_once_its_holder_lets_go(tmp_path: Path) -> None:
    path = tmp_path / "g2.lock"
    first = GenerationLock(path, "totals", 2)
    first.acquire()
    threading.Timer(1.0, first.release).start()
    second = GenerationLock(path, "totals", 2)
    started = time.monotonic()
    assert second.acquire(wait_s=30)
    assert 0.9 < time.monotonic() - started < 10
    assert f'"pid": {os.getpid()}' in path.read_text()
    second.release()


def test_a_wait_ends_when_a_stop_is_asked_and_a_wait_too_short_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "g2.lock"
    with GenerationLock(path, "totals", 2) as first:
        first.acquire()
        stop = threading.Event()
        threading.Timer(0.5, stop.set).start()
        waiting = GenerationLock(path, "totals", 2)
        assert waiting.acquire(wait_s=60, asked_to_stop=stop) is False
        assert not waiting.held
        with pytest.raises(GenerationBusy):
            GenerationLock(path, "totals", 2).acquire(wait_s=0.6)
    # descriptors of the refused tries are closed: the file's lock went with `first`
    assert GenerationLock(path, "totals", 2).acquire()


def test_the_generation_locked_is_the_one_readers_use_a_new_one_to_rebuild_or_the_first(tmp_path: Path) -> None:
    pytest.importorskip("pyspark")
    from esk.projections.runner import lock_generation

    tables = Tables(tmp_path)
    with lock_generation(tables, "totals", rebuild=False) as first:
        assert first.generation == 1
    tables.switch("totals", 4)
    with lock_generation(tables, "totals", rebuild=False) as current, lock_generation(tables, "totals", rebuild=True) as rebuilt:
        assert (current.generation, rebuilt.generation) == (4, 5)
        assert current.path == tmp_path / "_checkpoints" / "totals" / "g4.lock"
        with pytest.raises(GenerationBusy):  # a second rebuild at once would build the same generation
            lock_generation(tables, "totals", rebuild=True)


def test_several_read_models_are_refused_together_holding_none(tmp_path: Path) -> None:
    pytest.importorskip("pyspark")
    from esk.projections.runner import RunFailed, _lock_generations

    tables = Tables(tmp_path)
    with _held_elsewhere(tables.run_lock("totals", 1).path):
        with pytest.raises(RunFailed) as refused:
            _lock_generations(tables, ["adds", "totals"], rebuild=False)
        assert str(refused.value).startswith("totals: generation 1 is being run by another process (pid ")
        assert tables.run_lock("adds", 1).acquire()  # the lock taken before the refusal was let go


@pytest.mark.parametrize("kept_by_another", [False, True])
def test_a_continuous_run_follows_readers_once_the_rebuild_lets_go_or_leaves_it_to_a_run_that_keeps_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], kept_by_another: bool
) -> None:
    """runner.run's following, its generations' work (`_keep`: Spark's) stood in for: readers
    moved to generation 2 while it kept generation 1."""
    pytest.importorskip("pyspark")
    from rich.console import Console

    import esk
    from esk.projections import runner
    from esk.projections.catalog import Projection
    from esk.settings import Settings
    from tests.counters import counters

    base = Settings(_env_file=None)
    settings = base.model_copy(update={"projections": base.projections.model_copy(update={"warehouse_dir": tmp_path})})
    tables = Tables(tmp_path)
    tables.switch("totals", 1)
    projection = Projection(esk.ReadModel("totals", (counters,), "totals"), "counter_id STRING", lambda events, writer: 0)
    stop = runner.StopRequest()
    kept: list[tuple[int, bool]] = []

    def keep(settings: Settings, projection: Projection, generation: int, *_: object) -> runner.RunSummary:
        kept.append((generation, tables.run_lock("totals", generation).path.exists()))
        if generation == 1:
            tables.switch("totals", 2)  # a rebuild beside it, done
        else:
            stop.asked.set()  # the supervisor's stop, later
        return runner.RunSummary("totals", generation, caught_up=True)

    monkeypatch.setattr(runner, "_keep", keep)
    monkeypatch.setattr(runner, "FOLLOW_WAIT_S", 1.0)
    rebuild = tables.run_lock("totals", 2)
    if kept_by_another:
        with _held_elsewhere(rebuild.path):
            summary = runner.run(settings, projection, continuous=True, console=Console(soft_wrap=True), spark=object(), stop=stop)  # type: ignore[arg-type]
    else:
        assert rebuild.acquire()  # the rebuild, which lets go as it ends
        threading.Timer(0.5, rebuild.release).start()
        summary = runner.run(settings, projection, continuous=True, console=Console(soft_wrap=True), spark=object(), stop=stop)  # type: ignore[arg-type]
    output = capsys.readouterr().out
    assert "totals: readers were moved to generation 2 by another run: keeping that one up now" in output
    if kept_by_another:
        assert kept == [(1, True)] and summary.generation == 1
        assert "totals: generation 2 is kept up by another run (pid " in output and "leaving it to that one" in output
    else:
        assert kept == [(1, True), (2, True)] and summary.generation == 2
    # every lock it took is let go
    assert tables.run_lock("totals", 1).acquire() and tables.run_lock("totals", 2).acquire()
