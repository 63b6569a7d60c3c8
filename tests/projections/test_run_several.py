"""Several read models in one Spark driver (`esk project run NAME... | --all`, and `esk dev`'s),
run as a user runs them: each kept up, one JVM for all of them, a stop that stops them all
cleanly, and a read model that fails stopping the others and failing the process."""

from __future__ import annotations

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

import httpx
import psutil
import pytest

pytest.importorskip("pyspark")

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

import esk
from esk.broker.ports import free_port
from esk.projections.catalog import select_read_models
from esk.projections.runner import StopRequest, _turn
from esk.settings import Settings
from tests.counters import Added, counters
from tests.projections.test_read_your_writes import USER_READ_MODELS
from tests.system import esk_env

[TOTALS] = USER_READ_MODELS


def _counter_adds(events: DataFrame, writer: esk.BatchWriter) -> int:
    rows = (
        events.filter(esk.is_event(counters, Added))
        .groupBy(F.col("aggregate_id").alias("counter_id"))
        .agg(F.count(F.lit(1)).alias("adds"), F.max("version").alias("version"))
    )
    return writer.merge(
        rows,
        esk.Merge(on="t.counter_id = s.counter_id", update={"adds": "t.adds + s.adds", "version": "s.version"}, update_if="s.version > t.version"),
    )


def _broken(events: DataFrame, writer: esk.BatchWriter) -> int:
    if not events.isEmpty():  # past the run's check of its plan, over no events: a batch's failure
        raise ValueError("a bug in the user's read model")
    return 0


ADDS = esk.Projection(
    esk.ReadModel("counter_adds", (counters,), "how many adds each counter had", order_by=("counter_id",)),
    "counter_id STRING, adds BIGINT, version BIGINT",
    _counter_adds,
)
BROKEN = esk.Projection(esk.ReadModel("broken", (counters,), "fails on its first events"), "counter_id STRING", _broken)


def _mistyped(events: DataFrame, writer: esk.BatchWriter) -> int:
    return writer.append(events.select(F.col("agregate_id").alias("counter_id")))  # the typo a new read model has


MISTYPED = esk.Projection(esk.ReadModel("mistyped", (counters,), "a new read model with a typo"), "counter_id STRING", _mistyped)
TWO = [TOTALS, ADDS]
WITH_A_BROKEN_ONE = [TOTALS, BROKEN]
WITH_A_MISTYPED_ONE = [TOTALS, MISTYPED]
NO_SUBSCRIPTIONS: list[object] = []


def _settings(settings: Settings, tmp_path: Path, read_models: str) -> Settings:
    return settings.model_copy(
        update={
            "domain": "tests.counters:AGGREGATES",
            "read_models": f"{__name__}:{read_models}",
            "projections": settings.projections.model_copy(update={"warehouse_dir": tmp_path / "warehouse"}),
        }
    )


def test_read_models_are_chosen_by_name_or_all() -> None:
    projections = {p.model.name: p for p in TWO}
    assert select_read_models(projections, [], every=True) == TWO
    assert select_read_models(projections, ["counter_adds", "counter_totals", "counter_adds"], every=False) == [ADDS, TOTALS]
    for names, every, error in (
        ([], False, "name the read models to run, or give --all"),
        (["counter_adds"], True, "name the read models to run or give --all, not both"),
        (["counter_adds", "nope", "nor"], False, "no read model 'nope', 'nor'"),
    ):
        with pytest.raises(ValueError, match=error):
            select_read_models(projections, names, every)
    with pytest.raises(ValueError, match="the project has no read models"):
        select_read_models({}, [], every=True)


@pytest.mark.parametrize("name", ["_spark", "_checkpoints", "1st", "orders-by-day", "", "ünits"])
def test_a_read_model_s_name_is_a_folder_a_table_and_a_url(name: str) -> None:
    with pytest.raises(ValueError, match="a read model's name is a letter, then letters, digits or _"):
        esk.ReadModel(name, (counters,), "")
    assert esk.ReadModel("Orders_2", (counters,), "").name == "Orders_2"


def test_catch_ups_take_turns_and_a_stop_ends_the_wait() -> None:
    turn, stop = threading.Lock(), StopRequest()
    with _turn(turn, stop) as first:
        assert first and turn.locked()
        waited: list[bool] = []

        def second() -> None:
            with _turn(turn, stop) as taken:
                waited.append(taken)

        waiting = threading.Thread(target=second)
        waiting.start()
        waiting.join(0.3)
        assert waiting.is_alive()  # its turn has not come
        stop.asked.set()
        waiting.join(5)
        assert waited == [False]  # it stopped waiting, and holds nothing
    assert not turn.locked()
    with _turn(None, StopRequest()) as alone:  # a run of its own waits for no one
        assert alone


def _javas(process: psutil.Process) -> int:
    return sum(1 for child in process.children(recursive=True) if child.name() == "java")


@contextmanager
def _esk_dev(
    settings: Settings, tmp_path: Path, read_models: str
) -> Iterator[tuple[subprocess.Popen[bytes], httpx.Client, Path, dict[str, str]]]:
    """`esk dev` over the counters and `read_models`, in its own process group, its API ready;
    and its environment, for other esk commands of the same project (run in `tmp_path`)."""
    settings = _settings(settings, tmp_path, read_models)
    api_port = free_port()
    env = esk_env(
        settings,
        ESK_SUBSCRIPTIONS=f"{__name__}:NO_SUBSCRIPTIONS",
        ESK_API__PORT=str(api_port),
        ESK_API__STATE_DIR=str(tmp_path / "api"),
        ESK_PROCESSOR__STATE_DIR=str(tmp_path / "processor"),
        ESK_PROCESSOR__METRICS_PORT=str(free_port()),
        # the default's form, relative to where esk runs (Delta once refused such a location)
        ESK_PROJECTIONS__WAREHOUSE_DIR=".esk/warehouse",
        ESK_API__READ_WAIT_MAX_S="150",  # a read that waits for Spark's start and two catch-ups
        ESK_PROJECTIONS__OLD_GENERATIONS_KEPT_S="0",  # a generation readers left goes at once
    )
    log = tmp_path / "dev.log"
    with log.open("wb") as out:
        dev = subprocess.Popen(
            [sys.executable, "-m", "esk", "dev"], env=env, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{api_port}", timeout=30) as client:
            _until(lambda: _answers(client, "/readyz"), dev, log, "the API is ready")
            yield dev, client, log, env
    finally:
        if dev.poll() is None:
            os.killpg(dev.pid, signal.SIGKILL)
            dev.wait()


@pytest.mark.kafka
@pytest.mark.spark
def test_esk_dev_keeps_the_read_models_up_in_one_driver(settings: Settings, tmp_path: Path) -> None:
    def kept_up(client: httpx.Client, log: Path, command: str, body: dict[str, int], rows: dict[str, dict[str, object]]) -> None:
        """A command, then reads that wait for its position: each read model shows its row."""
        answer = client.post(f"/v1/counters/c1/{command}", json=body)
        assert answer.status_code == 200, answer.text
        token = answer.json()["position"]["token"]
        for name, row in rows.items():
            r = client.get(f"/v1/projections/{name}", params={"counter_id": "c1", "after": token, "wait_ms": 120_000}, timeout=150)
            assert r.status_code == 200, f"{r.text}\n{log.read_text()[-4000:]}"
            assert r.json()["rows"] == [row]

    with _esk_dev(settings, tmp_path, "TWO") as (dev, client, log, env):
        for command, body in (("start", {}), ("add", {"n": 2})):
            assert client.post(f"/v1/counters/c1/{command}", json=body).status_code == 200
        kept_up(client, log, "add", {"n": 5}, {
            "counter_adds": {"counter_id": "c1", "adds": 2, "version": 3},
            "counter_totals": {"counter_id": "c1", "total": 7, "version": 3},
        })
        assert _javas(psutil.Process(dev.pid)) == 1  # one driver for both (no embedded broker: one is given)
        # A rebuild beside it, as a user runs one: esk dev's driver takes the new generation
        # over, brings it to where its own stands, moves readers to it and keeps it up (it
        # would otherwise stand still at the rebuild's end).
        rebuilt = subprocess.run(
            [sys.executable, "-m", "esk", "project", "run", "counter_adds", "--rebuild"],
            env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240,
        )
        assert rebuilt.returncode == 0, rebuilt.stdout + rebuilt.stderr
        assert "counter_adds: readers now use generation 2, switched by the run that took it over" in rebuilt.stdout + rebuilt.stderr
        kept_up(client, log, "add", {"n": 1}, {"counter_adds": {"counter_id": "c1", "adds": 3, "version": 4}})
        assert "counter_adds: taking over generation 2, rebuilt beside this run" in log.read_text()
        # and removes the generation readers left (its table, checkpoint and lock)
        warehouse = tmp_path / ".esk" / "warehouse"
        # (said once all of it is gone: the table goes first, the checkpoint and lock after)
        _until(lambda: "counter_adds: removed generation(s) 1, which readers left" in log.read_text(), dev, log,
               "the generation readers left is removed")
        assert not (warehouse / "counter_adds" / "g1").exists()
        assert not (warehouse / "_checkpoints" / "counter_adds" / "g1").exists()
        assert (warehouse / "counter_totals" / "g1").is_dir()  # the one readers use
        # One run keeps a generation: a one-shot run beside esk dev's is refused before its
        # driver starts (it would share the checkpoint), naming esk dev's run
        beside = subprocess.run(
            [sys.executable, "-m", "esk", "project", "run", "counter_totals", "counter_adds"],
            env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60,
        )
        assert beside.returncode == 1, beside.stdout + beside.stderr
        assert "error: counter_totals: generation 1 is kept by another run (pid " in beside.stderr
        assert "esk project run --all --continuous" in beside.stderr
        assert "Spark" not in beside.stdout + beside.stderr  # no driver started
        # and `esk project list` names the run keeping each, and where each has read up to
        listed = subprocess.run(
            [sys.executable, "-m", "esk", "project", "list", "--format", "json"],
            env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60,
        )
        assert listed.returncode == 0, listed.stdout + listed.stderr
        rows = {row["name"]: row for row in map(json.loads, listed.stdout.splitlines())}
        assert set(rows) == {"counter_adds", "counter_totals"}, listed.stdout
        for row in rows.values():
            [keeper] = row["kept_by"]
            assert keeper.startswith("pid ") and "esk project run --all --continuous" in keeper, listed.stdout
            assert row["reads"] == ["counters"] and row["reflects"] and row["current_table"].endswith(("/g1", "/g2")), listed.stdout
        # an analyst's query, each read model a table by its name, as JSON Lines; Spark's
        # start says nothing on the way
        queried = subprocess.run(
            [sys.executable, "-m", "esk", "sql", "SELECT t.counter_id, total, adds FROM counter_totals t JOIN counter_adds USING (counter_id)",
             "--format", "json"],
            env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120,
        )
        assert queried.returncode == 0, queried.stdout + queried.stderr
        assert [json.loads(line) for line in queried.stdout.splitlines()] == [{"counter_id": "c1", "total": 8, "adds": 3}]
        # (the JVM's own line about the vector module Spark adds is all there is)
        assert [line for line in queried.stderr.splitlines() if line.strip() and "incubator modules" not in line] == [], queried.stderr
        wrong = subprocess.run(
            [sys.executable, "-m", "esk", "sql", "SELECT nope FROM counter_totals"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120
        )
        assert wrong.returncode == 1 and wrong.stderr.splitlines()[-1].startswith("error: [UNRESOLVED_COLUMN"), wrong.stderr
        # that line alone: not pyspark's query-context log of the error first, a stack trace
        said = [line for line in wrong.stderr.splitlines() if line.strip() and "incubator modules" not in line]
        assert len(said) == 1, wrong.stderr
        os.killpg(dev.pid, signal.SIGINT)  # Ctrl-C in its terminal: every process of the group gets it
        assert dev.wait(timeout=60) == 0, log.read_text()[-4000:]
    output = log.read_text()
    assert "read models, kept up by one Spark driver: counter_totals, counter_adds" in output
    # both runs' summaries: they stopped cleanly, together
    assert "counter_totals: generation 1" in output and "counter_adds: generation 2" in output
    assert "stopped in the middle of a batch" not in output and "Traceback" not in output
    assert "Failed to cancel job group" not in output  # Spark's warning about nothing, at each stop
    assert "Current batch is falling behind" not in output  # nor at each batch longer than the trigger's 0.5 s
    # nor the driver's start, nor each query's (session.LOG_CONFIG)
    assert "log4j" not in output and "NativeCodeLoader" not in output and "ResolveWriteToStream" not in output


@pytest.mark.kafka
@pytest.mark.spark
def test_a_read_model_that_fails_stops_the_others_and_esk_dev_goes_on_and_will_start_them_again(settings: Settings, tmp_path: Path) -> None:
    with _esk_dev(settings, tmp_path, "WITH_A_BROKEN_ONE") as (dev, client, log, _):
        assert client.post("/v1/counters/c1/start", json={}).status_code == 200
        # `esk project run --all --continuous`: only the failure ends it, the healthy read
        # model's run included, and the process fails
        failed = "the read models' driver exited (1); starting it again in 10 s, the rest going on meanwhile"
        _until(lambda: failed in log.read_text(), dev, log, "the read models to fail")
        output = log.read_text()
        assert "broken failed:" in output and "a bug in the user's read model" in output
        assert "stopped in the middle of a batch" not in output  # the healthy one stopped between batches
        assert "counter_totals: generation 1" in output  # and its summary is there, as a run's end
        # commands need no read model: the rest goes on
        assert client.post("/v1/counters/c1/add", json={"n": 1}).status_code == 200
        assert _javas(psutil.Process(dev.pid)) == 0
        # (that the driver is then started again, each time a little later:
        # tests/operations/test_restarted_child.py)
        dev.send_signal(signal.SIGTERM)
        assert dev.wait(timeout=60) == 0, log.read_text()[-4000:]


@pytest.mark.kafka
@pytest.mark.spark
def test_a_mistake_in_a_new_read_model_is_told_and_esk_dev_keeps_the_others_up(settings: Settings, tmp_path: Path) -> None:
    """A read model that cannot run as its code stands fails at its start whatever a restart
    does: esk dev's driver leaves it out, says why, and keeps the healthy one up."""
    with _esk_dev(settings, tmp_path, "WITH_A_MISTYPED_ONE") as (dev, client, log, _):
        answer = client.post("/v1/counters/c1/start", json={})
        assert answer.status_code == 200, answer.text
        token = answer.json()["position"]["token"]
        read = client.get("/v1/projections/counter_totals", params={"counter_id": "c1", "after": token, "wait_ms": 120_000}, timeout=150)
        assert read.status_code == 200, f"{read.text}\n{log.read_text()[-4000:]}"
        assert read.json()["rows"] == [{"counter_id": "c1", "total": 0, "version": 1}]
        output = log.read_text()
        assert "mistyped: its apply, planned over no events at the run's start, fails: [UNRESOLVED_COLUMN" in output, output[-4000:]
        assert "left out of this run, the other read models going on" in output
        assert "the read models' driver exited" not in output
        assert client.get("/v1/projections/mistyped").status_code == 503  # never built
        dev.send_signal(signal.SIGTERM)
        assert dev.wait(timeout=60) == 0, log.read_text()[-4000:]
    # its run's end says it again: the driver's stop fails it, naming the mistake
    assert "error: mistyped: its apply" in log.read_text()


def _answers(client: httpx.Client, path: str) -> bool:
    try:
        return client.get(path, timeout=2).status_code == 200
    except httpx.TransportError:  # not listening yet
        return False


def _until(holds: Callable[[], bool], dev: subprocess.Popen[bytes], log: Path, what: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not holds():
        assert dev.poll() is None, f"esk dev exited before {what}:\n{log.read_text()[-4000:]}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}:\n{log.read_text()[-4000:]}"
        time.sleep(0.2)
