"""esk as a user gets it: a wheel, installed non-editable, driving a project of the user's
own that has a package named `app` (as esk's checkout does) and its own domain, with no
checkout of this repository in sight.

The installed copy goes into a folder of its own that PYTHONPATH puts ahead of the venv's
site-packages, so it shadows the editable esk there while the venv still provides esk's
dependencies (nothing is installed from the network but the wheel's build tools)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import pytest

from esk.broker.ports import free_port
from esk.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
PYTHON = sys.executable
PIP = [PYTHON, "-m", "pip", "--disable-pip-version-check", "--quiet"]
# Build debris and anything large or private that a copy of the checkout must not carry.
NOT_SOURCE = shutil.ignore_patterns(
    ".git", ".venv", ".esk", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", "*.jar", ".env"
)

# The user's project: its own `app` package, a domain that uses only what `esk` exports,
# a helper module beside the package, and no read models (so nothing needs Spark).
USER_PROJECT = {
    "rules.py": """
        CLOSED_ALREADY = "the ticket is closed already"
    """,
    "app/__init__.py": """
        NAME = "user app"
    """,
    "app/shop.py": """
        from typing import Literal

        from pydantic import BaseModel

        import esk
        from app import NAME
        from esk import AggregateType, Command, Event, Rejection
        from rules import CLOSED_ALREADY


        class Open(Command):
            title: str


        class Close(Command):
            pass


        class Opened(Event):
            title: str


        class Closed(Event):
            pass


        class Ticket(BaseModel):
            title: str
            status: Literal["open", "closed"] = "open"
            # Evaluated in the processor that evolves the state, so the state read back
            # over HTTP says which `app` and which esk that process imported.
            app_name: str = NAME
            esk_file: str = esk.__file__


        def decide(state, command):
            match command:
                case Open(title=title):
                    return [Opened(title=title)]
                case Close():
                    if state.status == "closed":
                        return Rejection("ticket_closed", CLOSED_ALREADY)
                    return [Closed()]
            raise TypeError(f"unhandled command {command!r}")


        def evolve(state, event):
            match event:
                case Opened(title=title):
                    return Ticket(title=title)
                case Closed():
                    return state.model_copy(update={"status": "closed"})
            raise TypeError(f"unhandled event {event!r}")


        AGGREGATES = [
            AggregateType(
                name="tickets",
                state=Ticket,
                commands={"open": Open, "close": Close},
                creates=frozenset({Open}),
                events=[Opened, Closed],
                decide=decide,
                evolve=evolve,
            )
        ]
    """,
    "app/read_models.py": """
        READ_MODELS = []
    """,
}


@dataclass(frozen=True)
class Installed:
    wheel: Path
    site: Path

    @property
    def package(self) -> Path:
        return self.site / "esk"


def run(
    command: list[str | Path], cwd: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"{command} failed:\n{result.stdout}\n{result.stderr}"
    return result


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    """A wheel of this checkout, installed non-editable. Built from a copy: a build writes
    build/ and *.egg-info into its source tree, and others work in the checkout."""
    work = tmp_path_factory.mktemp("packaging")
    source = work / "source"
    shutil.copytree(ROOT, source, ignore=NOT_SOURCE)
    # With build isolation: the venv's setuptools is older than pyproject.toml asks for and
    # has no bdist_wheel, so pip brings the build requirements (from its cache once fetched).
    run([*PIP, "wheel", "--no-deps", "-w", work / "dist", source])
    (wheel,) = (work / "dist").glob("esk-*.whl")
    site = work / "site"
    # --no-compile: whatever lands in the package later was written by running it.
    run([*PIP, "install", "--no-deps", "--no-compile", "--target", site, wheel])
    return Installed(wheel, site)


@pytest.fixture
def project(tmp_path: Path) -> Path:
    root = tmp_path / "user-project"
    for name, text in USER_PROJECT.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(textwrap.dedent(text).lstrip())
    return root


def reopen_code(shop: Path) -> None:
    """The user's domain with a command more: `reopen`, which a closed ticket takes."""
    source = shop.read_text()
    for old, new in (
        ("class Close(Command):\n    pass\n", "class Close(Command):\n    pass\n\n\nclass Reopen(Command):\n    pass\n"),
        ("class Closed(Event):\n    pass\n", "class Closed(Event):\n    pass\n\n\nclass Reopened(Event):\n    pass\n"),
        ("            return [Closed()]\n", "            return [Closed()]\n        case Reopen():\n            return [Reopened()]\n"),
        ("        case Closed():\n", "        case Reopened():\n            return state.model_copy(update={\"status\": \"open\"})\n        case Closed():\n"),
        ('commands={"open": Open, "close": Close}', 'commands={"open": Open, "close": Close, "reopen": Reopen}'),
        ("events=[Opened, Closed]", "events=[Opened, Closed, Reopened]"),
    ):
        assert old in source, old
        source = source.replace(old, new)
    shop.write_text(source)


def user_env(installed: Installed, **esk: str) -> dict[str, str]:
    """The environment of a user's shell: the installed esk first on the path, and only the
    ESK_* settings given here (none leaks in from whoever runs the tests)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ESK_")}
    return {**env, "PYTHONPATH": str(installed.site), "NO_COLOR": "1", **esk}


def files_under(folder: Path) -> set[Path]:
    """Every file below `folder` but bytecode, which running a package may write."""
    return {p.relative_to(folder) for p in folder.rglob("*") if p.is_file() and "__pycache__" not in p.parts}


def test_the_wheel_holds_esk_and_its_poms_alone(installed: Installed) -> None:
    names = zipfile.ZipFile(installed.wheel).namelist()
    top_level = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
    assert top_level == {"esk"}, "the wheel must not install the checkout's app, domain or projections"
    # The broker's jars are resolved from this pom on first use: it has to travel with esk.
    assert "esk/jars/kafka/pom.xml" in names
    assert "esk/py.typed" in names


def test_the_installed_esk_shadows_the_checkout_and_the_user_app_is_theirs(installed: Installed, project: Path) -> None:
    shown = run(
        [PYTHON, "-c", "import app, esk; print(esk.__file__); print(app.__file__); print(app.NAME)"],
        cwd=project,
        env=user_env(installed),
    ).stdout.splitlines()
    assert shown == [str(installed.package / "__init__.py"), str(project / "app" / "__init__.py"), "user app"]
    assert not Path(shown[0]).is_relative_to(ROOT)


@pytest.mark.parametrize("command", [["topics", "init"], ["processor"], ["api"], ["dev"]], ids=" ".join)
def test_a_domain_that_is_not_there_is_a_one_line_error(installed: Installed, tmp_path: Path, command: list[str]) -> None:
    # Nothing listens on the bootstrap address: the domain must be checked before Kafka is.
    env = user_env(installed, ESK_DOMAIN="nosuch.domain:AGGREGATES", ESK_KAFKA__BOOTSTRAP_SERVERS=f"127.0.0.1:{free_port()}")
    result = subprocess.run([PYTHON, "-m", "esk", *command], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"error: ESK_DOMAIN=nosuch.domain:AGGREGATES: no module 'nosuch.domain' in {tmp_path} or on the Python path; "
        "set ESK_DOMAIN to where yours are"
    ]


@pytest.mark.parametrize(
    ("domain", "error"),
    [
        ("counters", "error: ESK_DOMAIN must look like 'package.module:ATTRIBUTE', got 'counters'"),
        ("counters:counters", "error: counters:counters names one AggregateType, not a list: it must name a list, each item an AggregateType"),
    ],
    ids=["no attribute", "one aggregate type, not a list"],
)
def test_a_domain_setting_of_the_wrong_form_is_a_one_line_error(installed: Installed, tmp_path: Path, domain: str, error: str) -> None:
    shutil.copy(ROOT / "tests" / "counters.py", tmp_path / "counters.py")
    env = user_env(installed, ESK_DOMAIN=domain, ESK_KAFKA__BOOTSTRAP_SERVERS=f"127.0.0.1:{free_port()}")
    result = subprocess.run([PYTHON, "-m", "esk", "dev"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and result.stderr.startswith(error), result.stderr


def test_topics_init_without_a_broker_is_a_one_line_error(installed: Installed, tmp_path: Path) -> None:
    shutil.copy(ROOT / "tests" / "counters.py", tmp_path / "counters.py")
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    env = user_env(installed, ESK_DOMAIN="counters:AGGREGATES", ESK_KAFKA__BOOTSTRAP_SERVERS=address)
    result = subprocess.run([PYTHON, "-m", "esk", "topics", "init"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stderr
    # the error, after the one warning esk's log gives of a broker it cannot reach
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: no Kafka broker answered at {address}, which making or checking the topics needs: start one (`esk broker start`; "
        "`esk dev` starts its own), or set ESK_KAFKA__BOOTSTRAP_SERVERS to yours"
    ), result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("module", "error"),
    [
        # not esk's spark extra (what the hint would say were it pyspark or delta-rs): theirs
        ("import nosuch_package_of_theirs\n", "No module named 'nosuch_package_of_theirs'"),
        ("import os\nraise RuntimeError('a bug of theirs')\n", "importing models failed at {path}:2: RuntimeError: a bug of theirs"),
        ("import json\njson.loads('{')\n", "importing models failed at {path}:2: JSONDecodeError: Expecting property name"),
        ("def broken(:\n", "importing models failed at {path}:1: SyntaxError: invalid syntax"),
    ],
    ids=["a package that is not there", "a module that raises", "raised in Python's own code", "a syntax error"],
)
def test_read_models_that_fail_to_import_are_a_one_line_error_naming_why(
    installed: Installed, tmp_path: Path, module: str, error: str
) -> None:
    (tmp_path / "models.py").write_text(module + "READ_MODELS = []\n")
    env = user_env(installed, ESK_READ_MODELS="models:READ_MODELS")
    result = subprocess.run([PYTHON, "-m", "esk", "project", "list"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1, result.stderr
    told = error.format(path=tmp_path / "models.py")
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(f"error: ESK_READ_MODELS=models:READ_MODELS: {told}"), line


@contextmanager
def esk_dev(project: Path, env: dict[str, str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """`esk dev` in its own process group, so that whatever a failing test leaves of it (its
    processor and API included) is ended: by that group's id, and only that group."""
    with log.open("wb") as out:
        process = subprocess.Popen(
            [PYTHON, "-m", "esk", "dev"],
            cwd=project,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        yield process
    finally:
        with suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def wait_until(holds: Callable[[], bool], what: str, process: subprocess.Popen[bytes], log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not holds():
        if process.poll() is not None:
            pytest.fail(f"esk dev exited ({process.returncode}) before {what}:\n{log.read_text()[-4000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}:\n{log.read_text()[-4000:]}")
        time.sleep(0.2)


def answers(url: str, holds: Callable[[httpx.Response], bool]) -> bool:
    try:
        return holds(httpx.get(url, timeout=2))
    except httpx.TransportError:  # not listening yet
        return False


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.kafka
@pytest.mark.parametrize("stop_signal", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_user_project_runs_its_own_domain_with_esk_dev(
    installed: Installed, project: Path, settings: Settings, tmp_path: Path, stop_signal: signal.Signals
) -> None:
    api_port, metrics_port = free_port(), free_port()
    env = user_env(
        installed,
        ESK_APP=settings.app,
        ESK_DOMAIN="app.shop:AGGREGATES",
        ESK_READ_MODELS="app.read_models:READ_MODELS",
        ESK_KAFKA__BOOTSTRAP_SERVERS=settings.bootstrap_servers,
        ESK_TOPICS__PARTITIONS="1",
        ESK_API__PORT=str(api_port),
        ESK_PROCESSOR__METRICS_PORT=str(metrics_port),
    )
    package_before = files_under(installed.package)
    # a lock file from before a change to an event under its version (a field dropped): esk
    # dev says so as its processes start
    shop = project / "app" / "shop.py"
    released = shop.read_text()
    shop.write_text(released.replace("class Opened(Event):\n    title: str\n", "class Opened(Event):\n    title: str\n    priority: str\n"))
    run([PYTHON, "-m", "esk", "schema", "lock"], cwd=project, env=env)
    shop.write_text(released)
    log = tmp_path / "esk-dev.log"
    with esk_dev(project, env, log) as dev:
        api = f"http://127.0.0.1:{api_port}"
        wait_until(lambda: answers(f"{api}/readyz", lambda r: r.status_code == 200), "the API is ready", dev, log, 90)
        # The processor owns the one partition: a command sent now is decided at once.
        wait_until(
            lambda: answers(f"http://127.0.0.1:{metrics_port}/metrics", lambda r: "esk_active_tasks 1.0" in r.text),
            "the processor owns its partition",
            dev,
            log,
            60,
        )
        assert "warning: tickets event Opened: field `priority` removed, but schema_version is still 1" in log.read_text()
        assert "warning: esk.lock.json: the events stored under it would no longer all be read (`esk schema check`)" in log.read_text()
        # one esk dev over the project's state: a second is refused, naming the first
        second = subprocess.run([PYTHON, "-m", "esk", "dev"], cwd=project, env=env, capture_output=True, text=True, timeout=60)
        assert second.returncode == 1
        assert second.stderr.startswith(f"error: esk dev runs here already (pid {dev.pid}), over .esk/state/processor: stop it first"), second.stderr
        with httpx.Client(base_url=api, timeout=30) as client:
            r = client.post("/v1/tickets/t1/open", json={"title": "printer on fire"}, headers={"If-None-Match": "*"})
            assert r.status_code == 200, r.text
            assert r.json()["version"] == 1
            assert [(e["type"], e["data"]) for e in r.json()["events"]] == [("Opened", {"title": "printer on fire"})]

            r = client.get("/v1/tickets/t1")
            assert r.status_code == 200, r.text
            assert r.json()["state"] == {
                "title": "printer on fire",
                "status": "open",
                "app_name": "user app",
                "esk_file": str(installed.package / "__init__.py"),
            }

            r = client.post("/v1/tickets/t1/close", json={}, headers={"If-Match": '"1"'})
            assert r.status_code == 200, r.text
            assert r.json()["version"] == 2 and [e["type"] for e in r.json()["events"]] == ["Closed"]

            # The user's (empty) read models are found in the project too, and need no Spark.
            r = client.get("/v1/projections/anything")
            assert r.status_code == 404 and r.json()["code"] == "unknown_projection", r.text

            # A change to the code while esk dev runs: the API takes the new command, the
            # processor decides it, with no restart by hand.
            reopen_code(project / "app" / "shop.py")

            def reopened() -> bool:
                try:
                    r = client.post("/v1/tickets/t1/reopen", json={}, headers={"Idempotency-Key": "reopen-t1"})
                except httpx.TransportError:  # between the processes' stop and their start
                    return False
                return r.status_code == 200

            wait_until(reopened, "the changed code runs", dev, log, 120)
            r = client.get("/v1/tickets/t1")
            assert r.json()["version"] == 3 and r.json()["state"]["status"] == "open", r.text
            assert "app/shop.py changed: starting esk dev's processes again" in log.read_text()

            # A mistake in a change stops the processes, not esk dev: the next change starts
            # them. Made in the helper module the domain imports, watched as the domain is.
            rules = project / "rules.py"
            working = rules.read_text()
            rules.write_text(working + "\ndef broken(:\n")
            wait_until(lambda: "esk dev's processes stopped (1): they start again at the next change" in log.read_text(),
                       "the mistake stops the processes", dev, log, 60)
            assert "rules.py changed: starting esk dev's processes again" in log.read_text()
            assert "SyntaxError" in log.read_text()
            rules.write_text(working)
            wait_until(lambda: answers(f"{api}/v1/tickets/t1", lambda r: r.status_code == 200), "the mended code runs", dev, log, 90)

        # a process that dies is named, the others are stopped, and the cause is told again
        # once they have (their own lines of their stop come between)
        (processor,) = [p for p in psutil.Process(dev.pid).children(recursive=True) if p.cmdline()[-1:] == ["processor"]]
        processor.kill()
        died = f"the processor (pid {processor.pid}) exited (killed by SIGKILL)"
        wait_until(lambda: f"esk dev stopped: {died}" in log.read_text(), "the processor's end is told", dev, log, 60)
        told = log.read_text()
        assert told.index(f"{died}; stopping the others") < told.index(f"esk dev stopped: {died}")

        dev.send_signal(stop_signal)  # the parent alone: it has to stop its children itself
        try:
            dev.wait(timeout=40)
        except subprocess.TimeoutExpired:
            pytest.fail(f"esk dev did not stop within 40 s of {stop_signal.name}:\n{log.read_text()[-4000:]}")
        assert dev.returncode == 0, f"esk dev was not stopped cleanly:\n{log.read_text()[-4000:]}"
        deadline = time.monotonic() + 10
        while group_alive(dev.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not group_alive(dev.pid), f"esk dev's processor or API outlived it:\n{log.read_text()[-4000:]}"
        # no restore progress bars off a terminal: they are drawn once, as the process ends,
        # as if the restore had not finished (a restore's log line tells it there)
        assert "restoring partition" not in log.read_text()

    # State lives where the user ran esk, and the installed package is left as installed.
    for state in (project / ".esk" / "state" / "processor", project / ".esk" / "state" / "api"):
        assert state.is_dir() and any(state.iterdir()), f"no state in {state}"
    assert files_under(installed.package) == package_before
