"""Runs a real Apache Kafka 4 broker+controller as a child JVM.

The jars come from Maven Central into esk's jar cache on first use (esk.jars). The data
directory holds the formatted KRaft storage, the generated server.properties, the pid
file and the broker log, and is kept across restarts.
"""

from __future__ import annotations

import asyncio
import base64
import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from aiokafka import AIOKafkaClient

from ..jars import JarsError, jars_dir
from ..settings import BrokerSettings

_LOG4J2 = """\
status = warn
appender.stdout.type = Console
appender.stdout.name = STDOUT
appender.stdout.layout.type = PatternLayout
appender.stdout.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = INFO
rootLogger.appenderRef.stdout.ref = STDOUT
logger.kafka.name = kafka
logger.kafka.level = INFO
logger.apache.name = org.apache.kafka
logger.apache.level = WARN
logger.state.name = state.change.logger
logger.state.level = WARN
"""


class BrokerError(RuntimeError):
    """A one-line, actionable reason why the broker cannot be started or reached."""


@dataclass(frozen=True)
class BrokerStatus:
    running: bool
    pid: int | None
    answering: bool
    bootstrap: str

    def describe(self) -> str:
        if self.running and self.answering:
            return f"up: pid {self.pid}, answering on {self.bootstrap}"
        if self.running:
            return f"starting or unhealthy: pid {self.pid}, not answering on {self.bootstrap}"
        return "down"


class EmbeddedBroker:
    def __init__(self, settings: BrokerSettings) -> None:
        self.settings = settings
        self.data_dir = Path(settings.data_dir).resolve()
        self.log_dir = self.data_dir / "kraft"
        self.pid_file = self.data_dir / "broker.pid"
        self.log_file = self.data_dir / "broker.log"
        self.properties_file = self.data_dir / "server.properties"
        self.log4j_file = self.data_dir / "log4j2.properties"

    @property
    def controller_port(self) -> int:
        return self.settings.controller_port or self.settings.port + 1

    @property
    def bootstrap(self) -> str:
        return f"{self.settings.host}:{self.settings.port}"

    # -- lifecycle ---------------------------------------------------------------

    def start(self) -> BrokerStatus:
        """Start the broker unless it runs already; return once it answers metadata requests."""
        current = self.status()
        if current.running:
            if not current.answering:
                self._wait_until_answering(None)
            return self.status()
        java = self._java()
        classpath = self._classpath()
        for port in (self.settings.port, self.controller_port):
            self._require_free_port(port)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._write_config()
        if not (self.log_dir / "meta.properties").exists():
            self._format(java, classpath)
        with open(self.log_file, "ab") as log:
            process = subprocess.Popen(
                [
                    java,
                    f"-Xmx{self.settings.heap}",
                    f"-Xms{self.settings.heap}",
                    "-XX:+UseG1GC",
                    "-Djava.awt.headless=true",
                    f"-Dlog4j2.configurationFile={self.log4j_file}",
                    "-cp",
                    classpath,
                    "kafka.Kafka",
                    str(self.properties_file),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # Ctrl-C in a terminal stops it through `stop`, gracefully
            )
        self.pid_file.write_text(str(process.pid))
        self._wait_until_answering(process)
        return self.status()

    def stop(self, timeout_s: float = 60.0) -> bool:
        """Stop gracefully (SIGTERM: controlled shutdown, logs flushed); SIGKILL as a last resort."""
        pid = self.pid()
        if pid is None:
            return False
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            self.pid_file.unlink(missing_ok=True)
            return False
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and _alive(pid):
            time.sleep(0.2)
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
            while _alive(pid):
                time.sleep(0.1)
        self.pid_file.unlink(missing_ok=True)
        return True

    def status(self) -> BrokerStatus:
        pid = self.pid()
        running = pid is not None
        answering = running and asyncio.run(_answers_metadata(self.bootstrap, 3.0))
        return BrokerStatus(running=running, pid=pid, answering=answering, bootstrap=self.bootstrap)

    # -- pieces ------------------------------------------------------------------

    def pid(self) -> int | None:
        """The broker's process id, if it runs (no network call: safe inside an event loop)."""
        try:
            pid = int(self.pid_file.read_text().strip())
        except (FileNotFoundError, ValueError):
            return None
        if not _alive(pid):
            self.pid_file.unlink(missing_ok=True)
            return None
        return pid

    def _java(self) -> str:
        java = shutil.which(self.settings.java)
        if java is None:
            raise BrokerError(
                f"Java not found ({self.settings.java!r}): install OpenJDK 17+ "
                "(apt-get install openjdk-17-jre-headless) or set ESK_BROKER__JAVA to its path"
            )
        return java

    def _classpath(self) -> str:
        try:
            folder = jars_dir("kafka", self.settings.jars_dir)
        except JarsError as error:
            raise BrokerError(str(error)) from None
        jars = sorted(folder.glob("*.jar"))
        if not any(jar.name.startswith("kafka_2.13-") for jar in jars):
            raise BrokerError(f"Kafka jars not found in {folder}: set ESK_BROKER__JARS_DIR to a folder that has them")
        return os.pathsep.join(str(jar) for jar in jars)

    def _require_free_port(self, port: int) -> None:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((self.settings.host, port))
            except OSError:
                raise BrokerError(
                    f"port {port} on {self.settings.host} is busy: stop what holds it "
                    "(`esk broker stop`, or `ss -ltnp | grep {port}`) or choose another with "
                    "ESK_BROKER__PORT / --port"
                ) from None

    def _write_config(self) -> None:
        host, port, cport = self.settings.host, self.settings.port, self.controller_port
        properties = {
            "process.roles": "broker,controller",
            "node.id": "1",
            # Static voters: the port may change between restarts without re-formatting.
            "controller.quorum.voters": f"1@{host}:{cport}",
            "listeners": f"PLAINTEXT://{host}:{port},CONTROLLER://{host}:{cport}",
            "advertised.listeners": f"PLAINTEXT://{host}:{port}",
            "controller.listener.names": "CONTROLLER",
            "inter.broker.listener.name": "PLAINTEXT",
            "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
            "log.dirs": str(self.log_dir),
            "num.partitions": "1",
            "auto.create.topics.enable": "false",
            # One node: every internal topic has a single replica.
            "offsets.topic.replication.factor": "1",
            "offsets.topic.num.partitions": "10",
            "transaction.state.log.replication.factor": "1",
            "transaction.state.log.min.isr": "1",
            "transaction.state.log.num.partitions": "10",
            "share.coordinator.state.topic.replication.factor": "1",
            "share.coordinator.state.topic.min.isr": "1",
            "group.initial.rebalance.delay.ms": "0",
            "log.cleaner.min.compaction.lag.ms": "0",
        }
        self.properties_file.write_text("".join(f"{k}={v}\n" for k, v in properties.items()))
        self.log4j_file.write_text(_LOG4J2)

    def _format(self, java: str, classpath: str) -> None:
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        result = subprocess.run(
            [
                java,
                f"-Dlog4j2.configurationFile={self.log4j_file}",
                "-cp",
                classpath,
                "kafka.tools.StorageTool",
                "format",
                f"--cluster-id={cluster_id}",  # one glued argument: an id may start with "-"
                "--config",
                str(self.properties_file),
                "--ignore-formatted",
            ],
            capture_output=True,
            text=True,
        )
        if result.returncode != 0:
            raise BrokerError(f"formatting {self.log_dir} failed: {result.stdout}{result.stderr}".strip())

    def _wait_until_answering(self, process: subprocess.Popen[bytes] | None) -> None:
        deadline = time.monotonic() + self.settings.start_timeout_s
        while time.monotonic() < deadline:
            if process is not None and process.poll() is not None:
                self.pid_file.unlink(missing_ok=True)
                raise BrokerError(
                    f"the broker exited with code {process.returncode}; last lines of {self.log_file}:\n"
                    + _tail(self.log_file, 15)
                )
            if asyncio.run(_answers_metadata(self.bootstrap, 2.0)):
                return
            time.sleep(0.3)
        raise BrokerError(
            f"the broker did not answer on {self.bootstrap} within {self.settings.start_timeout_s:.0f}s; "
            f"see {self.log_file}"
        )


async def _answers_metadata(bootstrap: str, timeout_s: float) -> bool:
    host, _, port = bootstrap.rpartition(":")
    try:  # a closed port is the common case while starting; don't let aiokafka log it
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)), timeout_s)
        writer.close()
    except (TimeoutError, OSError):
        return False
    client = AIOKafkaClient(bootstrap_servers=bootstrap, request_timeout_ms=int(timeout_s * 1000))
    try:
        await asyncio.wait_for(client.bootstrap(), timeout_s)
        return bool(client.cluster.brokers())
    except Exception:
        return False
    finally:
        await client.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child (exited, not yet reaped) is not alive.
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ", 1)[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return True


def _tail(path: Path, lines: int) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"
