"""Runs real Apache Kafka 4 broker+controller processes as child JVMs.

The jars come from Maven Central into esk's jar cache on first use (esk.jars). A
`BrokerNode` is one such process: its ports, its data directory (the formatted KRaft
storage, the generated server.properties, the pid file and the broker log, kept across
restarts) and the controller quorum it votes in. `EmbeddedBroker`, behind `esk broker`, is
the single-node case; `KafkaCluster` (cluster.py) runs several nodes in one quorum.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from aiokafka import AIOKafkaClient

from ..jars import JarsError, jars_dir
from ..processes import alive
from ..settings import BrokerSaslSslSettings, BrokerSettings

_LOOPBACK = "127.0.0.1"

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


def new_cluster_id() -> str:
    return base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")


def java_executable(java: str) -> str:
    found = shutil.which(java)
    if found is None:
        raise BrokerError(
            f"Java not found ({java!r}): install OpenJDK 17+ "
            "(apt-get install openjdk-17-jre-headless) or set ESK_BROKER__JAVA to its path"
        )
    return found


def kafka_classpath(folder: Path | None) -> str:
    """The broker's classpath: every jar of the `kafka` set (or of `folder`, if given)."""
    try:
        resolved = jars_dir("kafka", folder)
    except JarsError as error:
        raise BrokerError(str(error)) from None
    jars = sorted(resolved.glob("*.jar"))
    if not any(jar.name.startswith("kafka_2.13-") for jar in jars):
        raise BrokerError(f"Kafka jars not found in {resolved}: set ESK_BROKER__JARS_DIR to a folder that has them")
    return os.pathsep.join(str(jar) for jar in jars)


def controller_host(host: str, sasl_ssl: BrokerSaslSslSettings | None) -> str:
    """Where a node's controller listens. Behind a SASL_SSL client listener, loopback: the
    controller's listener is PLAINTEXT, and with the authorizer on its ANONYMOUS peers may
    do anything (its clients reach the cluster through the brokers)."""
    return host if sasl_ssl is None else _LOOPBACK


class BrokerNode:
    """One Kafka process, broker and controller in one, that votes in the quorum `voters`
    (`controller.quorum.voters`: every controller of the cluster, this one included).

    Kafka's internal topics (consumer offsets, transaction state) get `internal_replication`
    replicas, and writes to any topic without a setting of its own need a majority of
    them in sync: one node of three may then be lost without losing an acknowledged write.

    With `sasl_ssl`, clients reach `port` over TLS and authenticate with SCRAM; the node's
    own traffic (broker to broker, esk's "is it up" probe) uses a PLAINTEXT listener on a
    loopback port, so that it needs neither a truststore nor a user of its own.
    """

    def __init__(
        self,
        node_id: int,
        host: str,
        port: int,
        controller_port: int,
        data_dir: Path,
        voters: str,
        internal_replication: int,
        heap: str,
        sasl_ssl: BrokerSaslSslSettings | None = None,
    ) -> None:
        self.node_id = node_id
        self.host = host
        self.port = port
        self.controller_port = controller_port
        self.data_dir = data_dir.resolve()
        self.voters = voters
        self.internal_replication = internal_replication
        self.heap = heap
        self.sasl_ssl = sasl_ssl
        self.internal_port = None if sasl_ssl is None else sasl_ssl.internal_port or port + 2
        self.controller_host = controller_host(host, sasl_ssl)
        self.log_dir = self.data_dir / "kraft"
        self.pid_file = self.data_dir / "broker.pid"
        self.log_file = self.data_dir / "broker.log"
        self.properties_file = self.data_dir / "server.properties"
        self.log4j_file = self.data_dir / "log4j2.properties"
        self._process: subprocess.Popen[bytes] | None = None  # set when this object launched it

    @property
    def bootstrap(self) -> str:
        """Where clients connect."""
        return f"{self.host}:{self.port}"

    @property
    def probe_bootstrap(self) -> str:
        """Where esk asks whether the node answers: a PLAINTEXT listener."""
        return self.bootstrap if self.internal_port is None else f"{_LOOPBACK}:{self.internal_port}"

    def properties(self) -> dict[str, str]:
        majority = str(self.internal_replication // 2 + 1)
        return {
            "process.roles": "broker,controller",
            "node.id": str(self.node_id),
            # Static voters: a port may change between restarts without re-formatting.
            "controller.quorum.voters": self.voters,
            **self._listener_properties(),
            "log.dirs": str(self.log_dir),
            "num.partitions": "1",
            "auto.create.topics.enable": "false",
            "min.insync.replicas": majority,
            "offsets.topic.replication.factor": str(self.internal_replication),
            "offsets.topic.num.partitions": "10",
            "transaction.state.log.replication.factor": str(self.internal_replication),
            "transaction.state.log.min.isr": majority,
            "transaction.state.log.num.partitions": "10",
            "share.coordinator.state.topic.replication.factor": str(self.internal_replication),
            "share.coordinator.state.topic.min.isr": majority,
            "group.initial.rebalance.delay.ms": "0",
            "log.cleaner.min.compaction.lag.ms": "0",
            **(self._single_node_session() if "," not in self.voters else {}),
        }

    def _single_node_session(self) -> dict[str, str]:
        """A single node restarted is its own controller: Kafka 4.0's refuses the new broker's
        registration until the old one's session runs out (KAFKA-19130, fixed after 4.0), 9 s
        by default, so each restart took 10 s more than its start. The node heartbeats to
        itself over loopback: only a process stalled for 3 s would fence itself, until its
        next heartbeat."""
        return {"broker.session.timeout.ms": "3000", "broker.heartbeat.interval.ms": "1000"}

    def _listener_properties(self) -> dict[str, str]:
        host, port, cport, chost = self.host, self.port, self.controller_port, self.controller_host
        if self.sasl_ssl is None:
            return {
                "listeners": f"PLAINTEXT://{host}:{port},CONTROLLER://{host}:{cport}",
                "advertised.listeners": f"PLAINTEXT://{host}:{port}",
                "controller.listener.names": "CONTROLLER",
                "inter.broker.listener.name": "PLAINTEXT",
                "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
            }
        tls = self.sasl_ssl
        internal = f"INTERNAL://{_LOOPBACK}:{self.internal_port}"
        mechanism = tls.scram_mechanism
        keystore = {"ssl.keystore.type": tls.keystore_type, "ssl.keystore.location": str(Path(tls.keystore).resolve())}
        if tls.keystore_password is not None:
            # A PEM keystore has no password of its own, only its (encrypted) key has.
            if tls.keystore_type != "PEM":
                keystore["ssl.keystore.password"] = tls.keystore_password
            keystore["ssl.key.password"] = tls.keystore_password
        return {
            "listeners": f"SASL_SSL://{host}:{port},{internal},CONTROLLER://{chost}:{cport}",
            "advertised.listeners": f"SASL_SSL://{host}:{port},{internal}",
            "controller.listener.names": "CONTROLLER",
            "inter.broker.listener.name": "INTERNAL",
            "listener.security.protocol.map": "SASL_SSL:SASL_SSL,INTERNAL:PLAINTEXT,CONTROLLER:PLAINTEXT",
            "sasl.enabled.mechanisms": mechanism,
            # The server side of SCRAM needs a login module, though it logs in as no one:
            # the users' credentials are in the cluster metadata (written by `format`).
            f"listener.name.sasl_ssl.{mechanism.lower()}.sasl.jaas.config": (
                "org.apache.kafka.common.security.scram.ScramLoginModule required;"
            ),
            **keystore,
            **self._client_auth_properties(),
            **self._authorizer_properties(),
        }

    def _client_auth_properties(self) -> dict[str, str]:
        if self.sasl_ssl is None or self.sasl_ssl.client_ca is None:
            return {}
        # A SASL_SSL listener reads its client authentication only under its own prefix.
        return {
            "listener.name.sasl_ssl.ssl.client.auth": "required",
            "listener.name.sasl_ssl.ssl.truststore.type": "PEM",
            "listener.name.sasl_ssl.ssl.truststore.location": str(Path(self.sasl_ssl.client_ca).resolve()),
        }

    def _authorizer_properties(self) -> dict[str, str]:
        if self.sasl_ssl is None or not self.sasl_ssl.acls:
            return {}
        # The node's own listeners (controller, broker to broker, esk's probe) are PLAINTEXT on
        # loopback, where every peer is ANONYMOUS: the node itself (and any process of the
        # host), allowed everything.
        users = ["ANONYMOUS", *self.sasl_ssl.super_users]
        return {
            "authorizer.class.name": "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
            "super.users": ";".join(f"User:{name}" for name in users),
        }

    def _scram_users(self) -> list[str]:
        """`format` arguments that create the SCRAM users in the new cluster's metadata."""
        if self.sasl_ssl is None:
            return []
        mechanism = self.sasl_ssl.scram_mechanism
        arguments = []
        for name, password in self.sasl_ssl.users.items():
            arguments += ["--add-scram", f'{mechanism}=[name={_quoted(name)},password={_quoted(password)}]']
        return arguments

    def prepare(self, java: str, classpath: str, cluster_id: str) -> None:
        """Write the configuration, and format the storage unless it was formatted before
        (a restart keeps the node's data and its cluster id)."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.properties_file.write_text("".join(f"{k}={v}\n" for k, v in self.properties().items()))
        self.log4j_file.write_text(_LOG4J2)
        if (self.log_dir / "meta.properties").exists():
            return
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
                *self._scram_users(),
            ],
            capture_output=True,
            text=True,
        )
        if result.returncode != 0:
            raise BrokerError(f"formatting {self.log_dir} failed: {result.stdout}{result.stderr}".strip())

    def launch(self, java: str, classpath: str) -> None:
        """Start the JVM on a prepared data directory; it answers some seconds later."""
        self.require_free_ports()
        with open(self.log_file, "ab") as log:
            self._process = subprocess.Popen(
                [
                    java,
                    f"-Xmx{self.heap}",
                    f"-Xms{self.heap}",
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
        self.pid_file.write_text(str(self._process.pid))

    def pid(self) -> int | None:
        """The node's process id, if it runs (no network call: safe inside an event loop)."""
        try:
            pid = int(self.pid_file.read_text().strip())
        except (FileNotFoundError, ValueError):
            return None
        if not alive(pid):
            self._forget(pid)
            return None
        return pid

    def signal_stop(self) -> int | None:
        """SIGTERM (controlled shutdown, logs flushed), without waiting; the pid it went to."""
        pid = self.pid()
        if pid is None:
            return None
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            self._forget(pid)
            return None
        return pid

    def stop(self, timeout_s: float = 60.0) -> bool:
        """Stop gracefully (SIGTERM); SIGKILL as a last resort."""
        pid = self.signal_stop()
        if pid is None:
            return False
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and alive(pid):
            time.sleep(0.2)
        if alive(pid):
            self.kill()
        self._forget(pid)
        return True

    def kill(self) -> bool:
        """SIGKILL: the node dies at once, as in a crash (nothing flushed, no controlled
        shutdown); return once it is gone. False if it was not running."""
        pid = self.pid()
        if pid is None:
            return False
        with contextlib.suppress(ProcessLookupError):  # it died meanwhile
            os.kill(pid, signal.SIGKILL)
        while alive(pid):
            time.sleep(0.05)
        self._forget(pid)
        return True

    def answers(self, timeout_s: float = 3.0) -> bool:
        return asyncio.run(metadata_brokers(self.probe_bootstrap, timeout_s)) > 0

    def exit_code(self) -> int | None:
        """The exit code of the process this object launched, once it has exited."""
        process = self._process
        if process is None or process.poll() is None:
            return None
        self._forget(process.pid)
        return process.returncode

    def _forget(self, pid: int) -> None:
        """The process is gone: reap it if it is our child (no zombie left), drop the pid file."""
        if self._process is not None and self._process.pid == pid:
            self._process.wait()
            self._process = None
        self.pid_file.unlink(missing_ok=True)

    def require_free_ports(self) -> None:
        ports = [(self.host, self.port), (self.controller_host, self.controller_port)]
        if self.internal_port is not None:
            ports.append((_LOOPBACK, self.internal_port))
        for host, port in ports:
            if not port_is_free(host, port):
                raise BrokerError(
                    f"port {port} on {host} is busy: stop what holds it "
                    f"(`esk broker stop`, or `ss -ltnp | grep {port}`) or choose another with "
                    "ESK_BROKER__PORT / --port"
                )


class EmbeddedBroker:
    """The single-node broker of `esk broker` and `esk dev`: node 1, its own one-voter quorum."""

    def __init__(self, settings: BrokerSettings) -> None:
        self.settings = settings
        controller_port = settings.controller_port or settings.port + 1
        self.node = BrokerNode(
            node_id=1,
            host=settings.host,
            port=settings.port,
            controller_port=controller_port,
            data_dir=Path(settings.data_dir),
            voters=f"1@{controller_host(settings.host, settings.sasl_ssl)}:{controller_port}",
            internal_replication=1,
            heap=settings.heap,
            sasl_ssl=settings.sasl_ssl,
        )
        self.data_dir = self.node.data_dir
        self.log_file = self.node.log_file

    @property
    def controller_port(self) -> int:
        return self.node.controller_port

    @property
    def bootstrap(self) -> str:
        return self.node.bootstrap

    def start(self) -> BrokerStatus:
        """Start the broker unless it runs already; return once it answers metadata requests."""
        current = self.status()
        if current.running:
            if not current.answering:
                wait_until_answering([], self.node.probe_bootstrap, 1, self.settings.start_timeout_s)
            return self.status()
        java, classpath = self._java(), self._classpath()
        self.node.require_free_ports()  # before formatting: a clash is the likelier mistake
        self.node.prepare(java, classpath, new_cluster_id())
        self.node.launch(java, classpath)
        wait_until_answering([self.node], self.node.probe_bootstrap, 1, self.settings.start_timeout_s)
        return self.status()

    def stop(self, timeout_s: float = 60.0) -> bool:
        """Stop gracefully (SIGTERM: controlled shutdown, logs flushed); SIGKILL as a last resort."""
        return self.node.stop(timeout_s)

    def status(self) -> BrokerStatus:
        pid = self.pid()
        running = pid is not None
        answering = running and self.node.answers()
        return BrokerStatus(running=running, pid=pid, answering=answering, bootstrap=self.bootstrap)

    def pid(self) -> int | None:
        """The broker's process id, if it runs (no network call: safe inside an event loop)."""
        return self.node.pid()

    def _java(self) -> str:
        return java_executable(self.settings.java)

    def _classpath(self) -> str:
        return kafka_classpath(self.settings.jars_dir)


def wait_until_answering(launched: Sequence[BrokerNode], bootstrap: str, brokers: int, timeout_s: float) -> None:
    """Until `bootstrap` answers metadata requests naming at least `brokers` brokers; a
    BrokerError if a node of `launched` exits first, or after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for node in launched:
            code = node.exit_code()
            if code is not None:
                raise BrokerError(
                    f"broker {node.node_id} exited with code {code}; last lines of {node.log_file}:\n"
                    + _tail(node.log_file, 15)
                )
        if asyncio.run(metadata_brokers(bootstrap, 2.0)) >= brokers:
            return
        time.sleep(0.3)
    logs = ", ".join(str(node.log_file) for node in launched) or "the broker log"
    raise BrokerError(f"{bootstrap} did not answer with {brokers} broker(s) within {timeout_s:.0f}s; see {logs}")


async def metadata_brokers(bootstrap: str, timeout_s: float) -> int:
    """How many brokers a metadata request to `bootstrap` names (0: it did not answer)."""
    addresses = [address.rpartition(":") for address in bootstrap.split(",")]
    reachable = False
    for host, _, port in addresses:
        try:  # a closed port is the common case while starting; don't let aiokafka log it
            _, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)), timeout_s)
            writer.close()
            reachable = True
            break
        except (TimeoutError, OSError):
            continue
    if not reachable:
        return 0
    client = AIOKafkaClient(bootstrap_servers=bootstrap, request_timeout_ms=int(timeout_s * 1000))
    try:
        await asyncio.wait_for(client.bootstrap(), timeout_s)
        return len(client.cluster.brokers())
    except Exception:
        return 0
    finally:
        await client.close()


def port_is_free(host: str, port: int) -> bool:
    """Nothing listens on it: the kernel would let a server bind it now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return False
        return True


def _quoted(value: str) -> str:
    """A value for `format --add-scram`: it splits at every comma (no escape), and strips
    one pair of enclosing quotes, so a value in quotes keeps quotes of its own."""
    if "," in value:
        raise BrokerError("a SCRAM user's name or password for the embedded broker cannot contain a comma")
    return f'"{value}"'


def _tail(path: Path, lines: int) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"
