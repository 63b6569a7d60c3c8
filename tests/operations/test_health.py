"""The operations endpoints of the processor and subscriber processes (no Kafka needed:
what is served, and /readyz following the readiness it is given)."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from esk.broker.ports import free_port
from esk.cli import cli
from esk.health import CannotListen, LoopHeartbeat, serve_operations
from esk.metrics import Kind, exported
from esk.processes import hold_lock
from esk.runtime import API_LOCK
from esk.settings import Settings


def test_readyz_follows_readiness_and_metrics_are_served() -> None:
    ready = [False]
    port = free_port()
    serve_operations("127.0.0.1", port, lambda: ready[0], exported(Kind.PROCESSOR))
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=5) as client:
        assert client.get("/healthz").status_code == 200
        assert client.get("/readyz").status_code == 503
        ready[0] = True
        assert client.get("/readyz").status_code == 200
        metrics = client.get("/metrics")
        assert metrics.status_code == 200 and "esk_commands_total" in metrics.text
        assert client.get("/").status_code == 404 and client.get("/metricz").status_code == 404


def test_healthz_fails_once_the_event_loop_stalls() -> None:
    """The endpoints' thread answers whatever the loop does: the loop's heartbeat tells a
    loop stuck in a blocking call (a liveness probe then restarts the process)."""
    heartbeat = LoopHeartbeat(stall_s=0.5)
    port = free_port()
    serve_operations("127.0.0.1", port, lambda: True, exported(Kind.PROCESSOR), heartbeat.alive)
    healthz = f"http://127.0.0.1:{port}/healthz"
    assert httpx.get(healthz, timeout=5).status_code == 200  # before the loop runs: the process waits to start

    async def beating_then_stuck(stuck: threading.Event, freed: threading.Event) -> None:
        beating = asyncio.create_task(heartbeat.beat())
        await asyncio.sleep(0.3)
        assert heartbeat.alive()
        stuck.set()
        freed.wait(10)  # a blocking call: the loop runs nothing meanwhile
        await asyncio.sleep(0.3)
        beating.cancel()

    stuck, freed = threading.Event(), threading.Event()
    loop = threading.Thread(target=asyncio.run, args=(beating_then_stuck(stuck, freed),))
    loop.start()
    try:
        assert stuck.wait(10)
        time.sleep(1.0)
        stalled = httpx.get(healthz, timeout=5)
        assert (stalled.status_code, stalled.json()) == (503, {"status": "event loop stalled"})
    finally:
        freed.set()
        loop.join(10)


@pytest.mark.parametrize(
    ("kind", "own", "others"),
    [
        (Kind.PROCESSOR, "esk_active_tasks", ("esk_api_kafka_away", "esk_subscription_events_total")),
        (Kind.API, "esk_api_kafka_away", ("esk_active_tasks", "esk_commands_total", "esk_subscription_partitions")),
        (Kind.SUBSCRIBER, "esk_subscription_events_total", ("esk_active_tasks", "esk_api_kafka_away", "esk_read_model_lag")),
    ],
)
def test_each_kind_of_process_exports_its_own_metrics_and_the_process_s(kind: Kind, own: str, others: tuple[str, ...]) -> None:
    """Not the other kinds' at zero, which a dashboard counting series would take for a
    process of that kind."""
    port = free_port()
    serve_operations("127.0.0.1", port, lambda: True, exported(kind))
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    families = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}
    assert own in families and "process_cpu_seconds_total" in families, sorted(families)
    assert not set(others) & families, sorted(families)


def test_a_taken_address_is_told_in_a_line() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(CannotListen, match=rf"^cannot serve /metrics, /healthz and /readyz on 127\.0\.0\.1:{port}: Address already in use$"):
            serve_operations("127.0.0.1", port, lambda: True, exported(Kind.PROCESSOR))


@pytest.mark.kafka
@pytest.mark.parametrize(("command", "setting"), [(["processor"], "ESK_PROCESSOR__METRICS_PORT"), (["subscriber", "payments"], "ESK_SUBSCRIBER__METRICS_PORT")])
def test_a_second_process_on_a_taken_metrics_port_says_which_setting_to_change(
    settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: list[str], setting: str
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for name, value in {
            "ESK_APP": settings.app,
            "ESK_KAFKA__BOOTSTRAP_SERVERS": settings.bootstrap_servers,
            "ESK_PROCESSOR__STATE_DIR": str(tmp_path / "processor"),
            "ESK_SUBSCRIBER__DATA_DIR": str(tmp_path / "subscriptions"),
            setting: str(port),
            "COLUMNS": "250",
        }.items():
            monkeypatch.setenv(name, value)
        result = CliRunner().invoke(cli, command)
    assert result.exit_code == 1, result.output
    assert result.output.strip().splitlines() == [
        f"error: cannot serve /metrics, /healthz and /readyz on 127.0.0.1:{port}: Address already in use: give "
        f"each {command[0]} on this host its own {setting}"
    ]


@pytest.mark.kafka
def test_a_second_api_over_one_state_directory_is_refused_in_a_line(settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    held = hold_lock(tmp_path / "api" / API_LOCK)  # the first API's
    assert held is not None
    for name, value in {
        "ESK_APP": settings.app,
        "ESK_KAFKA__BOOTSTRAP_SERVERS": settings.bootstrap_servers,
        "ESK_API__STATE_DIR": str(tmp_path / "api"),
        "ESK_API__PORT": "0",
        "COLUMNS": "250",
    }.items():
        monkeypatch.setenv(name, value)
    try:
        result = CliRunner().invoke(cli, ["api"])
    finally:
        held.close()
    assert result.exit_code == 1, result.output
    assert result.output.strip().splitlines() == [
        f"error: another API (pid {os.getpid()}) runs over {tmp_path / 'api'}: give each its own ESK_API__STATE_DIR"
    ]


def test_an_api_on_a_taken_port_says_which_setting_to_change(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Told before it waits for a broker (none answers here), in a line, not by uvicorn's
    log and exit code 3."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for name, value in {
            "ESK_KAFKA__BOOTSTRAP_SERVERS": "127.0.0.1:9",
            "ESK_API__STATE_DIR": str(tmp_path / "api"),
            "ESK_API__PORT": str(port),
            "COLUMNS": "250",
        }.items():
            monkeypatch.setenv(name, value)
        result = CliRunner().invoke(cli, ["api"])
    assert result.exit_code == 1, result.output
    assert result.output.strip().splitlines() == [
        f"error: cannot serve the API on 127.0.0.1:{port}: Address already in use: give each API on this host its own "
        "ESK_API__PORT (or --port)"
    ]
