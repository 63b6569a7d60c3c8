"""One run at a time per read model generation (projections/run_lock.py): a second run is
refused before its driver starts, naming the first; a run that dies, however it dies,
leaves no lock behind. Pure: no Kafka, no Spark."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from esk.projections.catalog import Keepers, Projection, Tables
from esk.projections.run_lock import GenerationBusy, GenerationLock
from esk.settings import Settings

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
        assert f"generation 3 is kept by another run (pid {holder.pid} on " in message
        assert "-c " in message and "--continuous" in message  # the holder's command line
        assert "leave totals to that run, or stop it first" in message
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
    assert GenerationLock(path, "totals", 2).acquire()  # the file's lock went with `first`


def _descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_refused_stopped_and_failed_tries_leave_no_descriptor_open(tmp_path: Path) -> None:
    path = tmp_path / "g2.lock"
    before = _descriptors()
    with GenerationLock(path, "totals", 2) as first:
        first.acquire()
        for _ in range(3):
            with pytest.raises(GenerationBusy):
                GenerationLock(path, "totals", 2).acquire()
            stopped = threading.Event()
            stopped.set()
            assert not GenerationLock(path, "totals", 2).acquire(wait_s=5, asked_to_stop=stopped)
    unlockable = tmp_path / "a-folder.lock"
    unlockable.mkdir()
    with pytest.raises(OSError):  # opened for writing: it is a folder
        GenerationLock(unlockable, "totals", 2).acquire()
    assert _descriptors() == before


def test_the_holder_is_told_while_it_holds_and_not_once_it_is_gone(tmp_path: Path) -> None:
    path = tmp_path / "g3.lock"
    assert GenerationLock(path, "totals", 3).holder() is None  # no run ever kept it
    with _held_elsewhere(path) as holder:
        told = GenerationLock(path, "totals", 3).holder()
        assert told is not None and told.startswith(f"pid {holder.pid} on ") and "--continuous" in told
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert f'"pid": {holder.pid}' in path.read_text()  # its file still names it
    assert GenerationLock(path, "totals", 3).holder() is None
    with GenerationLock(path, "totals", 3) as mine:
        mine.acquire()
        assert GenerationLock(path, "totals", 3).holder() is not None  # this process, through another descriptor


def test_a_look_at_the_holder_as_a_run_starts_does_not_refuse_it(tmp_path: Path) -> None:
    """`esk project list` takes the lock shared for an instant; a one-shot run starting at
    that instant tries for a moment before it is refused."""
    pytest.importorskip("pyspark")
    from esk.projections.runner import hold_generation

    tables = Tables(tmp_path)
    path = tables.run_lock("totals", 1).path
    path.parent.mkdir(parents=True)
    looking = os.open(path, os.O_RDONLY | os.O_CREAT)
    fcntl.flock(looking, fcntl.LOCK_SH)
    threading.Timer(0.3, os.close, (looking,)).start()
    held = hold_generation(tables, "totals", False)
    assert held is not None and held.lock.generation == 1
    held.lock.release()


def test_a_rebuild_starts_its_generation_over_and_a_first_run_goes_on(tmp_path: Path) -> None:
    """A rebuild stopped before its switch left rows and parked aggregates of the code before
    a fix: the next `--rebuild` went on from them, and switched readers to them."""
    pytest.importorskip("pyspark")
    from esk.projections.runner import hold_generation

    tables = Tables(tmp_path)
    for generation in (1, 2):
        for folder in (tables.path("totals", generation), tables.checkpoint("totals", generation)):
            (folder / "left").mkdir(parents=True)
    held = hold_generation(tables, "totals", False)  # a first run, stopped midway, started again
    assert held is not None and held.lock.generation == 1 and (tables.checkpoint("totals", 1) / "left").exists()
    held.lock.release()
    tables.switch("totals", 1)
    tables.offer("totals", 2)
    held = hold_generation(tables, "totals", True)
    assert held is not None and held.lock.generation == 2
    assert not tables.path("totals", 2).exists() and not tables.checkpoint("totals", 2).exists()
    assert tables.offered("totals") is None and (tables.checkpoint("totals", 1) / "left").exists()
    held.lock.release()


def test_a_look_at_the_holder_as_a_rebuild_hands_over_does_not_keep_readers_back(tmp_path: Path) -> None:
    """A rebuild caught up beside a one-shot run that has ended takes its generation's lock
    to switch readers; a look (the API's, at a 503) at that instant read as a run that took
    the generation over, and readers stayed where they were, the rebuild saying all was done."""
    pytest.importorskip("pyspark")
    from esk.projections.runner import RunSummary, StopRequest, _hand_over

    tables = Tables(tmp_path)
    tables.switch("totals", 1)
    path = tables.run_lock("totals", 2).path
    path.parent.mkdir(parents=True, exist_ok=True)
    looking = os.open(path, os.O_RDONLY | os.O_CREAT)
    fcntl.flock(looking, fcntl.LOCK_SH)
    threading.Timer(0.3, os.close, (looking,)).start()
    summary = RunSummary("totals", 2, caught_up=True, handed_over=True)
    _hand_over(tables, "totals", 2, summary, StopRequest(), 600, lambda held: pytest.fail("it is not behind readers"))
    assert tables.current_generation("totals") == 2


def test_the_keepers_are_the_runs_of_the_generation_readers_use_and_of_the_next(tmp_path: Path) -> None:
    tables = Tables(tmp_path)
    with _held_elsewhere(tables.run_lock("totals", 1).path) as first:
        keepers = tables.keepers("totals")  # no readers yet: the first generation, being built
        assert keepers.current is None and list(keepers.runs) == [1] and keepers.standing_still() is None
        tables.switch("totals", 1)
        with _held_elsewhere(tables.run_lock("totals", 2).path) as rebuild:
            keepers = tables.keepers("totals")
            assert keepers.current == 1 and list(keepers.runs) == [1, 2] and keepers.standing_still() is None
            assert keepers.runs[1].startswith(f"pid {first.pid} on ") and keepers.runs[2].startswith(f"pid {rebuild.pid} on ")
        assert tables.keepers("totals") == Keepers(1, {1: keepers.runs[1]})
    assert tables.keepers("totals") == Keepers(1, {})
    with _held_elsewhere(tables.run_lock("totals", 2).path):
        assert tables.keepers("totals").standing_still() == 1  # no run keeps it while g2 is built
    assert tables.keepers("never-run") == Keepers(None, {})


def test_a_run_held_up_says_why_in_its_lock_for_readers(tmp_path: Path) -> None:
    """A read waiting on a run that cannot go on until someone acts (events newer than its
    code) is told so, rather than to retry (http.py `_who_keeps`, `esk project list`)."""
    tables = Tables(tmp_path)
    with tables.run_lock("totals", 1) as lock:
        lock.acquire()
        assert tables.keepers("totals").held_up == {} and tables.keepers("totals").held_up_reader() is None
        lock.held_up("events newer than this code")
        keepers = tables.keepers("totals")  # the first generation, being built
        assert keepers.held_up == {1: "events newer than this code"} and keepers.held_up_reader() == "events newer than this code"
        assert keepers.runs[1].startswith(f"pid {os.getpid()} on ")  # who it is, as before
        tables.switch("totals", 1)
        assert tables.keepers("totals").held_up_reader() == "events newer than this code"  # readers use it
        lock.held_up(None)
        assert tables.keepers("totals").held_up_reader() is None
        assert tables.keepers("totals").runs[1].startswith(f"pid {os.getpid()} on ")
        lock.held_up("again")
    assert tables.keepers("totals") == Keepers(1, {})  # a run that ended holds nothing up
    # nor does its file say so to a look at the next holder before that one writes its own
    assert "held_up" not in json.loads(tables.run_lock("totals", 1).path.read_text())


def test_a_continuous_run_says_in_its_lock_that_it_takes_offers(tmp_path: Path) -> None:
    """A rebuild beside the run keeping readers' generation offers it the new one only when
    that run says it takes offers (a continuous run): beside a one-shot run it waits for
    that run's end instead (runner._hand_over)."""
    tables = Tables(tmp_path)
    with tables.run_lock("totals", 1) as lock:
        lock.acquire()
        one_shot = tables.run_lock("totals", 1).keeper()
        assert one_shot is not None and not one_shot.takes_offers
        lock.held_up("events newer than this code")
        lock.takes_offers()
        keeper = tables.run_lock("totals", 1).keeper()
        assert keeper is not None and keeper.takes_offers and keeper.held_up == "events newer than this code"
        lock.held_up(None)
        keeper = tables.run_lock("totals", 1).keeper()
        assert keeper is not None and keeper.takes_offers and keeper.held_up is None  # one said, the other kept
    assert tables.run_lock("totals", 1).keeper() is None


def test_the_generation_held_is_the_one_readers_use_a_new_one_to_rebuild_or_the_first(tmp_path: Path) -> None:
    pytest.importorskip("pyspark")
    from esk.projections.runner import hold_generation

    tables = Tables(tmp_path)
    first = hold_generation(tables, "totals", False)
    assert first is not None and (first.lock.generation, first.building) == (1, True)
    first.lock.release()
    tables.switch("totals", 4)
    current = hold_generation(tables, "totals", False)
    rebuilt = hold_generation(tables, "totals", True)
    assert current is not None and rebuilt is not None
    with current.lock, rebuilt.lock:
        assert (current.lock.generation, current.building, rebuilt.lock.generation, rebuilt.building) == (4, False, 5, True)
        assert current.lock.path == tmp_path / "_checkpoints" / "totals" / "g4.lock"
        with pytest.raises(GenerationBusy):  # a second rebuild at once would build the same generation
            hold_generation(tables, "totals", True)


def test_readers_moved_while_the_lock_was_taken_make_it_choose_again(tmp_path: Path) -> None:
    """A run that read CURRENT, then took its lock as a rebuild elsewhere switched readers,
    must not keep (or, thinking it new, build again and switch back to) the old generation."""
    pytest.importorskip("pyspark")
    from esk.projections.runner import hold_generation

    tables = Tables(tmp_path)
    tables.switch("totals", 1)
    real_acquire = GenerationLock.acquire
    taken: list[int] = []

    def acquire_as_a_rebuild_ends(lock: GenerationLock, *args: object) -> bool:
        taken.append(lock.generation)
        if len(taken) == 1:
            tables.switch("totals", 2)
        return real_acquire(lock)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(GenerationLock, "acquire", acquire_as_a_rebuild_ends)
        held = hold_generation(tables, "totals", False)
    assert held is not None and (held.lock.generation, held.building) == (2, False) and taken == [1, 2]
    with held.lock, tables.run_lock("totals", 1) as first:
        assert first.acquire()  # the one it chose first was let go


def test_a_standby_waits_for_the_generation_readers_use_not_the_one_they_left(tmp_path: Path) -> None:
    """A continuous run waiting for generation 1 (another run keeps it), when a rebuild
    moves readers to generation 2: it takes 2 at once, not once 1 is let go."""
    pytest.importorskip("pyspark")
    from esk.projections.runner import StopRequest, _Waiting, hold_generation

    tables = Tables(tmp_path)
    tables.switch("totals", 1)
    with _held_elsewhere(tables.run_lock("totals", 1).path):
        threading.Timer(1.0, tables.switch, ("totals", 2)).start()
        started = time.monotonic()
        held = hold_generation(tables, "totals", False, _Waiting(StopRequest()))
        assert held is not None and held.lock.generation == 2 and time.monotonic() - started < 10
        held.lock.release()


def test_several_read_models_are_refused_together_holding_none(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("pyspark")
    from esk.projections import runner

    tables = Tables(tmp_path)
    with _held_elsewhere(tables.run_lock("totals", 1).path):
        with pytest.raises(runner.RunFailed) as refused:
            runner._hold_generations(tables, ["adds", "totals"], rebuild=False)
        assert str(refused.value).startswith("totals: generation 1 is kept by another run (pid ")
        with tables.run_lock("adds", 1) as adds:
            assert adds.acquire()  # the lock taken before the refusal was let go
    # any other error lets go of them too, and so does a driver that fails to start
    monkeypatch.setattr(Tables, "current_generation", lambda self, name: 1 if name == "adds" else _raise(PermissionError(13, "denied")))
    with pytest.raises(PermissionError):
        runner._hold_generations(tables, ["adds", "totals"], rebuild=False)
    monkeypatch.undo()
    monkeypatch.setattr(runner, "_driver_session", lambda settings, app: _raise(RuntimeError("no Java")))
    with pytest.raises(RuntimeError, match="no Java"):
        runner.run_several(_settings(tmp_path), [_projection("adds"), _projection("totals")])
    for name in ("adds", "totals"):
        with tables.run_lock(name, 1) as lock:
            assert lock.acquire()


def _raise(error: BaseException) -> int:
    raise error


def _settings(warehouse: Path) -> Settings:
    base = Settings(_env_file=None)
    return base.model_copy(
        update={"domain": "tests.counters:AGGREGATES", "projections": base.projections.model_copy(update={"warehouse_dir": warehouse})}
    )


def _projection(name: str) -> Projection:
    import esk
    from tests.counters import counters

    return Projection(esk.ReadModel(name, (counters,), name), "counter_id STRING", lambda events, writer: 0)


@pytest.mark.parametrize("other", ["a rebuild that ends", "a run that keeps it", "none: a stop"])
def test_a_continuous_run_follows_readers_to_a_new_generation_waiting_for_the_run_that_keeps_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, runner_said: Callable[[], str], other: str
) -> None:
    """runner.run's following, its generations' work (`_keep`: Spark's) stood in for:
    readers moved to generation 2 while it kept generation 1, and generation 2 is held
    by the rebuild that built it, or by another continuous run."""
    pytest.importorskip("pyspark")
    from esk.projections import runner

    tables = Tables(tmp_path)
    tables.switch("totals", 1)
    stop = runner.StopRequest()
    kept: list[tuple[int, bool]] = []
    elsewhere = tables.run_lock("totals", 2)

    def keep(settings: Settings, projection: Projection, held: runner.Held, *_: object) -> runner.RunSummary:
        with pytest.raises(GenerationBusy):  # it holds the generation as it keeps it
            tables.run_lock("totals", held.lock.generation).acquire()
        kept.append((held.lock.generation, held.building))
        if held.lock.generation == 1:
            tables.switch("totals", 2)  # the rebuild's switch; then that run ends, or this one is stopped, a while later
            threading.Timer(1.5, {"a rebuild that ends": elsewhere.release, "a run that keeps it": ends, "none: a stop": stop.asked.set}[other]).start()
        else:
            stop.asked.set()  # the supervisor's stop, later
        return runner.RunSummary("totals", held.lock.generation, batches=1, caught_up=True)

    monkeypatch.setattr(runner, "_keep", keep)
    monkeypatch.setattr(runner, "_driver_answers", lambda _spark: True)  # the driver stood in for too
    if other == "a rebuild that ends":
        assert elsewhere.acquire()
        ends = elsewhere.release
        summary = runner.run(_settings(tmp_path), _projection("totals"), continuous=True, spark=object(), stop=stop)  # type: ignore[arg-type]
    else:
        with _held_elsewhere(elsewhere.path) as holder:
            ends = holder.kill
            summary = runner.run(_settings(tmp_path), _projection("totals"), continuous=True, spark=object(), stop=stop)  # type: ignore[arg-type]
    output = runner_said()
    assert "totals: readers were moved to generation 2 by another run: keeping that one up now" in output
    if other == "none: a stop":
        assert kept == [(1, False)] and summary.standby and summary.batches == 1
    else:
        assert kept == [(1, False), (2, False)] and summary.generation == 2 and summary.batches == 2
    if other != "a rebuild that ends":
        assert "totals: waiting for generation 2, which another run keeps (pid " in output
    # every lock it took is let go
    with tables.run_lock("totals", 1) as first, tables.run_lock("totals", 2) as second:
        assert first.acquire() and second.acquire()


def test_a_run_stopped_before_it_held_a_generation_says_so_and_no_lag_it_does_not_know(tmp_path: Path) -> None:
    """A stop while the driver still started (esk dev's processes started again for a
    change): not "waited for another run", which there was none of; and a run that ended
    before any batch knows no lag, which is not "lag 0"."""
    pytest.importorskip("pyspark")
    from rich.console import Console

    from esk.projections import runner

    Tables(tmp_path).switch("totals", 1)
    stop = runner.StopRequest()
    stop.asked.set()
    summary = runner.run(_settings(tmp_path), _projection("totals"), continuous=True, spark=object(), stop=stop)  # type: ignore[arg-type]
    assert (summary.started, summary.standby) == (False, False)
    console = Console(record=True, width=200)
    runner._print_summaries([summary, runner.RunSummary("adds", 2), runner.RunSummary("ends", 1, batches=3, lag={"t/0": 0}, caught_up=True)], console)
    assert console.export_text().splitlines() == [
        "totals: stopped before it started",
        "adds: generation 2, 0 batches, 0 events, 0 rows written",
        "adds: stopped before it caught up; readers stay where they were",
        "ends: generation 1, 3 batches, 0 events, 0 rows written; lag 0",
    ]
