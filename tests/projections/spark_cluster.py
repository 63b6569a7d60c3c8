"""A Spark standalone cluster on loopback for tests: one master and its workers, started
from the launcher classes of the pyspark distribution installed here (its `bin/spark-class`
and jars), so the suite needs no Spark download.

    with SparkCluster(tmp_path / "spark") as cluster:
        subprocess.run([SPARK_HOME / "bin" / "spark-submit", "--master", cluster.url, ...], env=cluster.environment)
        cluster.tasks_per_worker(app_id)  # which worker ran how many of the application's tasks

Each JVM runs in a process group of its own, logs to `<work_dir>/<name>.log`, and is killed
with its group on exit: a worker's executors are its children, so none outlives it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import pyspark

from esk.broker.ports import free_port

HOST = "127.0.0.1"
SPARK_HOME = Path(pyspark.__file__).parent


@dataclass
class _Daemon:
    name: str
    process: subprocess.Popen[bytes]
    webui_port: int
    log: Path


@dataclass
class SparkCluster:
    work_dir: Path
    workers: int = 2
    # The machine is small and shared: a core and a small executor per worker.
    worker_cores: int = 1
    worker_memory: str = "1g"
    executor_memory: str = "512m"  # an executor's heap; Spark refuses less than ~450m
    start_timeout_s: float = 60.0
    port: int = field(default_factory=free_port)
    _daemons: list[_Daemon] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"spark://{HOST}:{self.port}"

    @property
    def environment(self) -> dict[str, str]:
        """What the cluster's JVMs, and a spark-submit against it, run with: everything on
        loopback, and a configuration folder of their own rather than the user's."""
        return {**os.environ, "SPARK_HOME": str(SPARK_HOME), "SPARK_LOCAL_IP": HOST, "SPARK_CONF_DIR": str(self.conf_dir)}

    @property
    def conf_dir(self) -> Path:
        return self.work_dir / "conf"

    @property
    def event_log(self) -> Path:
        return self.work_dir / "events"

    def start(self) -> None:
        self.event_log.mkdir(parents=True, exist_ok=True)
        self.conf_dir.mkdir(exist_ok=True)
        # spark-submit's defaults (it reads SPARK_CONF_DIR): executors that fit the workers,
        # and an event log, which says which executor ran each task.
        defaults = {
            "spark.executor.memory": self.executor_memory,
            "spark.executor.cores": str(self.worker_cores),
            # Jobs start once every worker's executor is up: a slow start leaves none idle.
            "spark.scheduler.minRegisteredResourcesRatio": "1.0",
            "spark.scheduler.maxRegisteredResourcesWaitingTime": "120s",
            "spark.eventLog.enabled": "true",
            "spark.eventLog.compress": "false",
            "spark.eventLog.rolling.enabled": "false",  # one file per application
            "spark.eventLog.dir": self.event_log.as_uri(),
        }
        (self.conf_dir / "spark-defaults.conf").write_text("".join(f"{k} {v}\n" for k, v in defaults.items()))
        try:
            self._launch("master", "org.apache.spark.deploy.master.Master", "--port", str(self.port))
            for n in range(1, self.workers + 1):
                work = self.work_dir / f"worker-{n}"
                work.mkdir(exist_ok=True)
                options = ["--cores", str(self.worker_cores), "--memory", self.worker_memory, "--work-dir", str(work)]
                self._launch(f"worker-{n}", "org.apache.spark.deploy.worker.Worker", *options, self.url)
            self._await_workers()
        except BaseException:
            self.stop()
            raise

    def _launch(self, name: str, main_class: str, *args: str) -> _Daemon:
        webui_port = free_port()
        log = self.work_dir / f"{name}.log"
        command = [str(SPARK_HOME / "bin" / "spark-class"), main_class, "--host", HOST, "--webui-port", str(webui_port), *args]
        with log.open("wb") as out:
            process = subprocess.Popen(command, env=self.environment, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        daemon = _Daemon(name, process, webui_port, log)
        self._daemons.append(daemon)
        return daemon

    def _await_workers(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            for daemon in self._daemons:
                if daemon.process.poll() is not None:
                    raise RuntimeError(f"Spark {daemon.name} exited at start:\n{daemon.log.read_text()[-3000:]}")
            try:
                alive = [w for w in self.master_state()["workers"] if w["state"] == "ALIVE"]
            except OSError:  # the master's web UI is not up yet
                alive = []
            if len(alive) == self.workers:
                return
            time.sleep(0.3)
        raise TimeoutError(f"{self.workers} Spark workers did not register with {self.url} in {self.start_timeout_s:.0f}s; logs in {self.work_dir}")

    def master_state(self) -> dict[str, Any]:
        """The master's own account (its web UI's /json): workers, applications."""
        return self._json(self._daemons[0])

    def worker_states(self) -> list[dict[str, Any]]:
        """Each worker's account (/json of its web UI): among others, its executors."""
        return [self._json(d) for d in self._daemons[1:]]

    def tasks_per_worker(self, app_id: str) -> dict[str, int]:
        """How many of a finished application's tasks each worker's executors ran, by worker id."""
        worker_of = {
            str(executor["id"]): worker["id"]
            for worker in self.worker_states()
            for executor in worker["finishedexecutors"] + worker["executors"]
            if executor["appid"] == app_id
        }
        tasks = {worker["id"]: 0 for worker in self.worker_states()}
        with (self.event_log / app_id).open() as log:
            for line in log:
                event = json.loads(line)
                if event["Event"] == "SparkListenerTaskEnd":
                    tasks[worker_of[event["Task Info"]["Executor ID"]]] += 1
        return tasks

    @staticmethod
    def _json(daemon: _Daemon) -> dict[str, Any]:
        with urllib.request.urlopen(f"http://{HOST}:{daemon.webui_port}/json/", timeout=5) as response:
            state: dict[str, Any] = json.load(response)
        return state

    def stop(self) -> None:
        """Workers first (each takes its executors along), then the master."""
        for daemon in reversed(self._daemons):
            _stop_group(daemon.process)
        self._daemons.clear()

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()


def _stop_group(process: subprocess.Popen[bytes], grace_s: float = 10.0) -> None:
    """SIGTERM to the process group started with `process`, then SIGKILL to whatever of it
    outlived the grace period (the JVM itself, or an executor it started)."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(grace_s)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()
