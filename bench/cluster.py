"""Real esk processes for harnesses: `esk api`, `esk processor`, `esk subscriber` and
`esk project run` as child processes, each with its own state directory, port and log file;
and fresh applications (their own topics) on a running broker."""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn, Protocol, TypeVar

import httpx
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console
from rich.table import Table

from esk.broker import EmbeddedBroker
from esk.broker.ports import free_port, free_port_pair
from esk.kafka.topics import ensure_topics, topic_specs
from esk.registry import load_registry
from esk.settings import BrokerSettings, Settings


@dataclass
class EskProcess:
    role: str  # "api", "processor", "subscriber" or "project"
    name: str
    env: dict[str, str]
    log_path: Path
    port: int  # HTTP or metrics; 0 for a process that serves none
    args: tuple[str, ...] = ()
    process: subprocess.Popen[bytes] | None = None
    starts: int = 0

    def start(self) -> None:
        self.starts += 1
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child owns it
        log.write(f"\n=== start {self.starts} ===\n".encode())
        log.flush()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "esk", self.role, *self.args], env=self.env, stdout=log, stderr=subprocess.STDOUT
        )

    def signal(self, sig: signal.Signals) -> None:
        assert self.process is not None
        self.process.send_signal(sig)

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def stop(self, timeout_s: float = 30) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()

    @property
    def pid(self) -> int:
        assert self.process is not None, f"{self.name} was never started"
        return self.process.pid

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def metrics_text(self, timeout_s: float = 2) -> str:
        """This process's /metrics page; raises httpx.HTTPError when it does not answer."""
        return httpx.get(f"http://127.0.0.1:{self.port}/metrics", timeout=timeout_s).text

    def metric(self, name: str, **labels: str) -> float | None:
        """The sum of a metric's samples whose labels include `labels`; None when there is
        no such sample or the process does not answer."""
        try:
            return metric_sum(self.metrics_text(), name, **labels)
        except httpx.HTTPError:
            return None

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")


def metric_sum(text: str, name: str, **labels: str) -> float | None:
    """The sum of the samples named `name` whose labels include `labels`, in a /metrics page."""
    total = None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total = (total or 0.0) + sample.value
    return total


@dataclass
class Cluster:
    settings: Settings
    workdir: Path
    processes: list[EskProcess] = field(default_factory=list)

    def _env(self, extra: dict[str, str]) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("ESK_")}
        env.update(
            {
                "ESK_APP": self.settings.app,
                "ESK_KAFKA__BOOTSTRAP_SERVERS": self.settings.bootstrap_servers,
                "ESK_TOPICS__PARTITIONS": str(self.settings.topics.partitions),
                "ESK_LOG_LEVEL": "INFO",
                "PYTHONUNBUFFERED": "1",  # a log that is complete up to the instant the process ends
                "ESK_DOMAIN": self.settings.domain,
                **extra,
            }
        )
        return env

    def processor(self, name: str, **settings: str) -> EskProcess:
        port = free_port()
        env = self._env(
            {
                "ESK_PROCESSOR__STATE_DIR": str(self.workdir / name),
                "ESK_PROCESSOR__METRICS_PORT": str(port),
                **settings,
            }
        )
        return self._add(EskProcess("processor", name, env, self.workdir / f"{name}.log", port))

    def api(self, name: str, **settings: str) -> EskProcess:
        port = free_port()
        env = self._env({"ESK_API__STATE_DIR": str(self.workdir / name), "ESK_API__PORT": str(port), **settings})
        return self._add(EskProcess("api", name, env, self.workdir / f"{name}.log", port))

    def subscriber(self, name: str, subscription: str, data_dir: Path, **settings: str) -> EskProcess:
        """`esk subscriber SUBSCRIPTION`; a database handler's SQLite file goes in `data_dir`,
        which members on one host share."""
        port = free_port()
        env = self._env(
            {
                "ESK_SUBSCRIPTIONS": self.settings.subscriptions,
                "ESK_SUBSCRIBER__DATA_DIR": str(data_dir),
                "ESK_SUBSCRIBER__METRICS_PORT": str(port),
                **settings,
            }
        )
        return self._add(EskProcess("subscriber", name, env, self.workdir / f"{name}.log", port, (subscription,)))

    def projection(self, name: str, read_model: str, continuous: bool = True, **settings: str) -> EskProcess:
        """`esk project run READ_MODEL [--continuous]`. Stopping it (SIGTERM) lets the batch in
        flight end; one cut short is safe as well: every batch's Delta writes are idempotent
        and the next run goes on from the checkpoint."""
        env = self._env(settings)
        args = ("run", read_model, *(("--continuous",) if continuous else ()))
        return self._add(EskProcess("project", name, env, self.workdir / f"{name}.log", 0, args))

    def _add(self, process: EskProcess) -> EskProcess:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.processes.append(process)
        return process

    def start_all(self, timeout_s: float = 120) -> None:
        """Start every process not running yet; return once each API answers /readyz and the
        processors own every partition between them."""
        for process in self.processes:
            if not process.alive:
                process.start()
        for api in (p for p in self.processes if p.role == "api"):
            wait_until(functools.partial(api_ready, api.url), timeout_s, f"{api.name} to be ready")
        processors = [p for p in self.processes if p.role == "processor"]
        partitions = self.settings.topics.partitions
        wait_until(lambda: sum(p.metric("esk_active_tasks") or 0 for p in processors) >= partitions * bool(processors),
                   timeout_s, "the processors to own every partition")

    def stop_all(self) -> None:
        for process in self.processes:
            process.stop()


async def new_app(settings: Settings, suffix: str, **updates: Any) -> Settings:
    """A fresh application on the same broker (`<app><suffix>`): its own topics, groups and
    state, so a workload neither sees nor disturbs another's records."""
    fresh = settings.model_copy(update={"app": f"{settings.app}{suffix}", **updates})
    report = await ensure_topics(fresh, topic_specs(fresh, load_registry(fresh.domain)))
    if report.problems:
        raise RuntimeError(report.problems)
    return fresh


def api_ready(api_url: str) -> bool:
    try:
        return httpx.get(f"{api_url}/readyz", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def wait_until(predicate: Callable[[], object], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(0.1)


def scratch_settings(broker: EmbeddedBroker, app_prefix: str, partitions: int) -> Settings:
    """Settings for a fresh application on a scratch broker."""
    return Settings(
        app=f"{app_prefix}{uuid.uuid4().hex[:6]}",
        kafka={"bootstrap_servers": broker.bootstrap},
        topics={"partitions": partitions},
        _env_file=None,
    )


T = TypeVar("T")


def workload_arguments(description: str | None, more: Callable[[argparse.ArgumentParser], object] | None = None) -> argparse.Namespace:
    """The options of one workload run on its own (`python -m bench.<workload>`); `more`
    adds a workload's own."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the sizes of bench-quick")
    parser.add_argument("--partitions", type=int, default=6)
    parser.add_argument("--budget-mb", type=int, default=128)
    if more is not None:
        more(parser)
    return parser.parse_args()


def run_harness(main: Coroutine[Any, Any, T]) -> T:
    """asyncio.run for a harness: SIGTERM cancels `main` as Ctrl-C does, so that its
    `finally` blocks stop the scratch broker and the child processes on the way out."""

    async def cancellable() -> T:
        task = asyncio.current_task()
        assert task is not None

        def cancel_once() -> None:  # a second SIGTERM must not cut the clean-up short
            if not task.cancelling():
                task.cancel()

        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, cancel_once)
        return await main

    try:
        return asyncio.run(cancellable())
    except asyncio.CancelledError:
        raise SystemExit(128 + signal.SIGTERM) from None


@asynccontextmanager
async def scratch_broker(prefix: str) -> AsyncIterator[EmbeddedBroker]:
    """An embedded broker of its own (free ports, a fresh directory) for one benchmark run;
    stopped and removed afterwards."""
    data_dir = Path(tempfile.mkdtemp(prefix=f"{prefix}-broker-"))
    broker = EmbeddedBroker(BrokerSettings(port=free_port_pair(), data_dir=data_dir, heap="1g"))
    await asyncio.to_thread(broker.start)
    try:
        yield broker
    finally:
        await asyncio.to_thread(broker.stop)
        shutil.rmtree(data_dir, ignore_errors=True)


@asynccontextmanager
async def harness_application(name: str, console: Console) -> AsyncIterator[tuple[Settings, Path]]:
    """A harness's fresh application, on a scratch broker of its own unless the settings
    name a Kafka cluster (then it is used as configured), and a work directory for logs."""
    async with AsyncExitStack() as stack:
        settings = Settings(app=f"{name}{uuid.uuid4().hex[:6]}")
        if settings.uses_embedded_broker:
            broker = await stack.enter_async_context(scratch_broker(f"esk-{name}"))
            settings = scratch_settings(broker, name, settings.topics.partitions)
            console.print(f"broker on {broker.bootstrap}")
        workdir = Path(tempfile.mkdtemp(prefix=f"esk-{name}-"))
        console.print(f"app {settings.app}; logs in {workdir}")
        yield settings, workdir


class Verdict(Protocol):
    notes: list[str]

    @property
    def ok(self) -> bool: ...

    def table(self, title: str) -> Table: ...


def exit_with(verdict: Verdict, title: str, console: Console, notes: int = 20) -> NoReturn:
    """Print a harness's verdict (its table and its first notes) and exit 0 only if it holds."""
    console.print(verdict.table(title))
    for note in verdict.notes[:notes]:
        console.print(note, highlight=False)
    raise SystemExit(0 if verdict.ok else 1)
