"""Process entry points behind `esk processor`, `esk api`, `esk subscriber` and `esk dev`."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from aiokafka.errors import KafkaError, ProducerFenced
from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn

from . import tracing
from .health import LoopHeartbeat, bound_socket, serve_operations
from .kafka.errors import broker_away
from .metrics import Kind, exported
from .processes import hold_lock, kill_tree, set_from_signal_handler
from .processing.processor import Processor
from .registry import Registry, load_registry
from .schema.recorded import hold_to_recorded_schemas
from .settings import Settings
from .state.allocator import return_large_blocks
from .state.restore import RestoreProgress

if TYPE_CHECKING:
    from .code_watch import CodeWatch

log = logging.getLogger(__name__)


def _hold_to_recorded_schemas(settings: Settings, registry: Registry, wait: Callable[[], None]) -> None:
    """Before any event is written: not an event of a shape the brokers hold another of. A
    broker gone between `wait` and the read (a restart, an election) is waited for again, as
    at the start, rather than ending the processor with a traceback."""
    while True:
        try:
            asyncio.run(hold_to_recorded_schemas(settings, registry, refuse=DEV_CHILD_VARIABLE not in os.environ))
            return
        except (KafkaError, OSError) as error:
            if not broker_away(error):
                raise
            log.warning("the recorded schemas could not be read (%r): waiting for Kafka again", error)
        wait()


def run_processor(settings: Settings, wait: Callable[[], None] = lambda: None) -> None:
    """The processor, once `wait` (for a broker, for its topics) has returned; its operations
    endpoints answer meanwhile (alive, not ready), and a port another process has is told
    before any waiting."""
    return_large_blocks()
    tracing.setup(settings, "processor")
    registry = load_registry(settings.domain)
    heartbeat = LoopHeartbeat()
    running: list[Processor] = []
    if settings.processor.metrics_port is not None:
        serve_operations(
            settings.processor.metrics_host, settings.processor.metrics_port, lambda: bool(running) and running[0].ready,
            exported(Kind.PROCESSOR), heartbeat.alive,
        )
    wait()
    _hold_to_recorded_schemas(settings, registry, wait)
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed:,.0f}/{task.total:,.0f} records  {task.fields[rate]:,.0f}/s"),
        transient=False,
        # Off a terminal (a log file, a container's log) bars are drawn once, as the
        # process ends, and would look like a restore that never finished; the restore's log
        # line says the same there.
        disable=not Console().is_terminal,
    ) as bars:
        shown: dict[tuple[str, int], TaskID] = {}

        def show(progress: RestoreProgress) -> None:
            if progress.total == 0:
                return
            bar = progress.what, progress.partition
            if bar not in shown:
                shown[bar] = bars.add_task(f"{progress.what} partition {progress.partition}", total=progress.total, rate=0.0)
            bars.update(shown[bar], completed=progress.restored, rate=progress.rate)

        processor = Processor(settings, registry, on_restore_progress=show)
        running.append(processor)
        _freeze_startup_objects()
        asyncio.run(_until_signalled(processor.run, heartbeat, "the processor"))


async def _until_signalled(main: Callable[[asyncio.Event], Awaitable[None]], heartbeat: LoopHeartbeat, what: str) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    signalled: list[str] = []

    def asked(sig: signal.Signals) -> None:
        signalled.append(sig.name)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, asked, sig)
    loop.set_exception_handler(told_fences_quiet)
    beating = asyncio.create_task(heartbeat.beat(), name="loop-heartbeat")
    try:
        await main(stop)
    finally:
        beating.cancel()
    if signalled:  # a clean stop, which a supervisor's log should show as one
        log.info("%s stopped (%s)", what, signalled[0])


def told_fences_quiet(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """The event loop's handler of errors nothing handled: a transactional producer's fence
    is left by aiokafka on futures nothing awaits (its transaction's, a batch's), which
    asyncio logs as they are collected, an ERROR with a traceback, long after esk told the
    fence where it met it (a task given up, a partition started again). Anything else is
    logged as asyncio would."""
    if isinstance(context.get("exception"), ProducerFenced) and "never retrieved" in str(context.get("message", "")):
        log.debug("a fence aiokafka left unretrieved: %r", context["exception"])
        return
    loop.default_exception_handler(context)


def _freeze_startup_objects() -> None:
    """Leave what was made at startup (modules, pydantic schemas, the clients' classes:
    tens of thousands of objects that live as long as the process) out of every later
    garbage collection, which kept walking them all (docs/benchmarks.md, probes)."""
    gc.collect()
    gc.freeze()


def run_api(settings: Settings, wait: Callable[[], None] = lambda: None) -> None:
    """The API, once `wait` (for a broker) has returned; its state directory held and its
    port bound first, so that either taken is told at once (HeldElsewhere, CannotListen)."""
    # Imported here: FastAPI and uvicorn are a third of a second of a processor's start
    # (W3's time to ready) that it has no use for.
    import uvicorn

    from .api.http import create_app, server_options

    # Its stores (the changelog replica, the history index) are RocksDB's, one process's at a
    # time: a second API over them is refused here, in a line, not in the app's startup.
    held = hold_lock(Path(settings.api.state_dir) / API_LOCK)  # raises HeldElsewhere
    listening: socket.socket | None = None
    try:
        listening = bound_socket(settings.api.host, settings.api.port, "the API")
        wait()
        return_large_blocks()
        tracing.setup(settings, "api")
        registry = load_registry(settings.domain)
        app = create_app(settings, registry)
        _freeze_startup_objects()
        server = uvicorn.Server(uvicorn.Config(app, **server_options(settings)))
        refusal_told_once = _NotWhileRefused(app)
        logging.getLogger("uvicorn.error").addFilter(refusal_told_once)
        try:
            server.run(sockets=[listening])
        except SystemExit:  # uvicorn's, at a failed start
            if app.state.refused is not None:
                raise app.state.refused from None
            raise
        finally:
            logging.getLogger("uvicorn.error").removeFilter(refusal_told_once)
        if not server.started:  # its startup failed (uvicorn.run exits 3 then): a supervisor must see a failure
            raise SystemExit(3)
    finally:
        if listening is not None:
            listening.close()
        if held is not None:
            held.close()


class _NotWhileRefused(logging.Filter):
    """uvicorn's lines about a start the cluster's authorizer refused (its traceback, "startup
    failed"): the caller tells the refusal in a line of its own."""

    def __init__(self, app: Any) -> None:
        super().__init__()
        self.app = app

    def filter(self, record: logging.LogRecord) -> bool:
        return self.app.state.refused is None


def run_subscriber(settings: Settings, name: str, wait: Callable[[], None] = lambda: None) -> None:
    """One subscription's consumer group member, once `wait` has returned (as run_processor)."""
    from .subscriptions.catalog import configured_subscriptions
    from .subscriptions.runner import SubscriptionRunner

    tracing.setup(settings, f"subscriber-{name}")
    registry = load_registry(settings.domain)
    heartbeat = LoopHeartbeat()
    runner = SubscriptionRunner(settings, configured_subscriptions(settings)[name], registry)
    if settings.subscriber.metrics_port is not None:
        # A subscriber takes no requests: ready once it runs, its stores open (its lag is in
        # /metrics); not while it waits for a broker, its topics or its database.
        serve_operations(
            settings.subscriber.metrics_host, settings.subscriber.metrics_port, lambda: runner.ready, exported(Kind.SUBSCRIBER), heartbeat.alive
        )
    wait()
    _freeze_startup_objects()
    asyncio.run(_until_signalled(runner.run, heartbeat, f"the subscriber of {name}"))


# Above the read models' wait for their batch in flight (projections.runner.STOP_WAIT_S, 20 s).
DEV_STOP_TIMEOUT_S = 30.0
# The read models' driver, when it exits under `esk dev`, is started again after a delay
# that doubles with each exit, up to the last; one that ran for a while starts from the first.
DRIVER_RESTART_DELAYS_S = (10.0, 20.0, 40.0, 80.0, 160.0, 300.0)
DRIVER_RAN_WELL_S = 300.0


class RestartedChild:
    """A child process that `esk dev` starts again when it exits: the read models' driver.
    Its failure (a read model's bug, a broker away) must not leave the tables standing still
    until esk dev is restarted; and as a new process it runs the read models' code as it is
    then, so a fix is taken up at the next start."""

    def __init__(self, command: list[str], env: dict[str, str], what: str) -> None:
        self.command, self.env, self.what = command, env, what
        self.process: subprocess.Popen[bytes] | None = None
        self.started = self.due = 0.0
        self.exits = 0  # in a row, each soon after its start

    def watch(self) -> None:
        """Starts it when it is due; notes its exit, and when to start it again."""
        now = time.monotonic()
        if self.process is None:
            if now >= self.due:
                self.process = _spawn(self.command, self.env)
                self.started = now
            return
        code = self.process.poll()
        if code is None:
            return
        self.process = None
        self.exits = 1 if now - self.started >= DRIVER_RAN_WELL_S else self.exits + 1
        delay_s = DRIVER_RESTART_DELAYS_S[min(self.exits, len(DRIVER_RESTART_DELAYS_S)) - 1]
        self.due = now + delay_s
        log.error("%s exited (%d); starting it again in %.0f s, the rest going on meanwhile", self.what, code, delay_s)


class StopSignals:
    """SIGINT and SIGTERM as a request to stop, noted rather than raised: a second one, or one
    that reaches esk dev while it stops its processes (Ctrl-C reaches every process of the
    terminal's group, the one above it included), must not cut that stop short."""

    def __init__(self) -> None:
        self.asked = threading.Event()
        self._before: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        for stop_signal in (signal.SIGINT, signal.SIGTERM):
            self._before[stop_signal] = signal.signal(stop_signal, lambda *_: set_from_signal_handler(self.asked))
        return self

    def __exit__(self, *_: object) -> None:
        for stop_signal, handler in self._before.items():
            signal.signal(stop_signal, handler)


def stop_all(children: list[subprocess.Popen[bytes]], timeout_s: float = DEV_STOP_TIMEOUT_S) -> None:
    """SIGTERM to each, then one deadline for all of them, not one each: Ctrl-C should not
    take minutes. A child still stopping then is killed, which loses nothing (G5): what it
    had not committed is handled again by the next start."""
    for child in children:
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for child in children:
        try:
            child.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            log.warning("child process %d did not stop in time; killing it", child.pid)
            kill_tree(child)


# esk's own command line, in this interpreter: how esk dev starts its processes.
ESK = [sys.executable, "-m", "esk"]


# In the environment of the `esk dev --no-reload` below an esk dev that watches the code:
# the file descriptor of the lock that esk dev holds, which it hands down to it.
DEV_LOCK_FD_VARIABLE = "_ESK_DEV_LOCK_FD"
# Set in the environment of the processes esk dev starts (a processor under esk dev only
# warns of code that breaks the events stored under the lock file: esk dev has).
DEV_CHILD_VARIABLE = "_ESK_DEV_CHILD"
DEV_LOCK = "esk-dev.lock"
API_LOCK = "esk-api.lock"
# The lock's descriptor, which every process esk dev starts gets a copy of: the lock
# holds while any of them lives (a parent killed alone leaves its processes running).
_lock_fds: tuple[int, ...] = ()


def hold_dev_lock(settings: Settings) -> None:
    """One esk dev over one processor state directory (and so one project's data and
    ports); below an esk dev, the one it holds. Raises HeldElsewhere."""
    global _lock_fds
    inherited = os.environ.get(DEV_LOCK_FD_VARIABLE)
    if inherited is not None:
        _lock_fds = (int(inherited),)
    elif (held := hold_lock(Path(settings.processor.state_dir) / DEV_LOCK)) is not None:
        _HELD.append(held)
        _lock_fds = (held.fileno(),)


_HELD: list[IO[str]] = []  # open for this process's life


def _spawn(command: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    """One of esk dev's processes, with its copy of the lock."""
    return subprocess.Popen(command, env=env, pass_fds=_lock_fds)


def _children_env(settings: Settings) -> dict[str, str]:
    """esk dev's processes use its broker, the embedded one included."""
    env = {k: v for k, v in os.environ.items() if k != DEV_LOCK_FD_VARIABLE}
    return {**env, "ESK_KAFKA__BOOTSTRAP_SERVERS": settings.bootstrap_servers, DEV_CHILD_VARIABLE: "1"}


def run_dev(settings: Settings, subscriptions: list[str], read_models: bool = False) -> int:
    """API, processor, each subscription and (`read_models`) the read models, all of them in
    one Spark driver, as child processes (as in production), until Ctrl-C or one of them
    exits; the exit code: 1 when one exited on its own. The read models' driver alone may
    end (a read model that fails, one following a rebuild of newer code, no Java): the rest goes on,
    as commands need none of it, and the driver is started again (RestartedChild)."""
    env = _children_env(settings)
    with StopSignals() as stop:
        named = {
            "the processor": _spawn([*ESK, "processor"], env),
            "the API": _spawn([*ESK, "api"], env),
        }
        first_port = settings.subscriber.metrics_port
        for n, name in enumerate(subscriptions):
            # each on a metrics port of its own, the next one up
            port = {"ESK_SUBSCRIBER__METRICS_PORT": str(first_port + n)} if first_port is not None else {}
            named[f"the subscriber of {name}"] = _spawn([*ESK, "subscriber", name], {**env, **port})
        children = list(named.values())
        driver = RestartedChild([*ESK, "project", "run", "--all", "--continuous", "--leave-out-invalid"], env, "the read models' driver") if read_models else None
        ended = ""  # why esk dev ends on its own: told again as its last line, below the others' stop
        try:
            while not stop.asked.wait(0.5):
                if exited := [(what, child) for what, child in named.items() if child.poll() is not None]:
                    what, child = exited[0]
                    ended = f"{what} (pid {child.pid}) exited ({_exit_status(child.returncode)})"
                    log.error("%s; stopping the others", ended)
                    break
                if driver is not None:
                    driver.watch()
        finally:
            if driver is not None and driver.process is not None:
                children.append(driver.process)
            stop_all(children)
    if ended:
        log.error("esk dev stopped: %s", ended)
        return 1
    return 0


def _exit_status(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


def run_dev_reloading(settings: Settings, watch: CodeWatch) -> int:
    """esk dev's processes, under a parent of their own (`esk dev --no-reload`), until
    Ctrl-C, started again with the code as it is whenever the project's code changes.
    They exiting on their own ends this too, with their exit code, unless the code changed
    since esk dev started: then it is likely the change's fault, and they are started again
    at the next change (as `uvicorn --reload` waits for one)."""
    processes, env = [*ESK, "dev", "--no-reload"], _children_env(settings)
    if _lock_fds:
        env[DEV_LOCK_FD_VARIABLE] = str(_lock_fds[0])
    # above the processes' own stop, which ends by killing those still stopping
    stop_timeout_s = DEV_STOP_TIMEOUT_S + 10
    reloaded = False
    with StopSignals() as stop:
        running: subprocess.Popen[bytes] | None = _spawn(processes, env)
        try:
            while not stop.asked.wait(0.5):
                if changed := watch.changed():
                    shown = ", ".join(sorted(str(path.relative_to(Path.cwd()) if path.is_relative_to(Path.cwd()) else path) for path in changed))
                    log.info("%s changed: starting esk dev's processes again with the code as it is now", shown)
                    if running is not None:
                        stop_all([running], stop_timeout_s)
                    watch.changed()  # saved while they stopped: the processes about to start have those too
                    if stop.asked.is_set():  # Ctrl-C while they stopped: nothing to start
                        break
                    running, reloaded = _spawn(processes, env), True
                elif running is not None and (code := running.poll()) is not None:
                    if not reloaded:
                        return code
                    running = None
                    log.error(
                        "esk dev's processes stopped (%d): they start again at the next change to %s (Ctrl-C ends esk dev)",
                        code, ", ".join(map(str, watch.paths)),
                    )
            return 0
        finally:
            if running is not None:
                stop_all([running], stop_timeout_s)
