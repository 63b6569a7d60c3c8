"""A Kafka cluster of several nodes on this machine, for tests and harnesses that must see
what a broker failure does: every node is broker and controller at once, all of them
voters of one KRaft quorum, each on free loopback ports with a data directory of its own.

Kafka's internal topics (consumer offsets, transaction state) are replicated to every
node, and a write needs a majority of replicas in sync: with three nodes, any one may be
killed and restarted without losing an acknowledged write or the quorum.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from aiokafka.admin import AIOKafkaAdminClient

from .embedded import (
    BrokerError,
    BrokerNode,
    java_executable,
    kafka_classpath,
    new_cluster_id,
    wait_until_answering,
)
from .ports import listening_ports


class KafkaCluster:
    """`size` nodes, numbered from 1: `start()` starts them all, `kill(n)` crashes one,
    `start(n)` brings it back on its own data, `stop()` ends them all."""

    def __init__(
        self,
        data_dir: Path,
        size: int = 3,
        heap: str = "384m",
        host: str = "127.0.0.1",
        java: str = "java",
        jars_dir: Path | None = None,
        start_timeout_s: float = 120.0,
    ) -> None:
        self.data_dir = data_dir.resolve()
        self.java = java
        self.jars_dir = jars_dir
        self.start_timeout_s = start_timeout_s
        self.cluster_id = new_cluster_id()
        ports = listening_ports(host, 2 * size)
        ids = range(1, size + 1)
        controller_ports = {n: ports[2 * n - 1] for n in ids}
        voters = ",".join(f"{n}@{host}:{controller_ports[n]}" for n in ids)
        self.nodes = {
            n: BrokerNode(
                node_id=n,
                host=host,
                port=ports[2 * n - 2],
                controller_port=controller_ports[n],
                data_dir=self.data_dir / f"node-{n}",
                voters=voters,
                internal_replication=size,
                heap=heap,
            )
            for n in ids
        }

    @property
    def size(self) -> int:
        return len(self.nodes)

    @property
    def bootstrap(self) -> str:
        """Every node's address: a client reaches the cluster through whichever answers."""
        return ",".join(node.bootstrap for node in self.nodes.values())

    def running(self) -> list[int]:
        return [n for n, node in self.nodes.items() if node.pid() is not None]

    def start(self, node_id: int | None = None) -> None:
        """Start every node that is not running (or only `node_id`, on its own data, as a
        restart after a kill); return once the started nodes answer and the cluster names
        all of its brokers."""
        java, classpath = java_executable(self.java), kafka_classpath(self.jars_dir)
        wanted = [self.nodes[node_id]] if node_id is not None else list(self.nodes.values())
        starting = [node for node in wanted if node.pid() is None]
        with ThreadPoolExecutor(max(len(starting), 1)) as pool:  # formatting is a JVM start each
            list(pool.map(lambda node: node.prepare(java, classpath, self.cluster_id), starting))
        # All at once: no node finishes starting before a majority of the voters is up.
        for node in starting:
            node.launch(java, classpath)
        try:
            for node in starting:
                wait_until_answering(starting, node.bootstrap, self.size, self.start_timeout_s)
        except BrokerError:
            for node in starting:
                node.kill()
            raise

    def kill(self, node_id: int) -> bool:
        """SIGKILL one node, as a crash; False if it was not running."""
        return self.nodes[node_id].kill()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop every node: SIGTERM to all at once, SIGKILL to any still running after `timeout_s`."""
        for node in self.nodes.values():
            node.signal_stop()
        deadline = time.monotonic() + timeout_s
        while self.running() and time.monotonic() < deadline:
            time.sleep(0.2)
        for node in self.nodes.values():
            node.kill()

    def under_replicated(self, timeout_s: float = 10.0) -> list[str] | None:
        """The partitions (every topic's, Kafka's own included) with a replica out of sync,
        as `topic/partition`; None when the cluster does not answer."""
        try:
            return asyncio.run(asyncio.wait_for(self._under_replicated(), timeout_s))
        except Exception:
            return None

    async def _under_replicated(self) -> list[str]:
        admin = AIOKafkaAdminClient(bootstrap_servers=self.bootstrap)
        await admin.start()
        try:
            topics: list[dict[str, Any]] = await admin.describe_topics()
        finally:
            await admin.close()
        return [
            f"{topic['topic']}/{partition['partition']}"
            for topic in topics
            for partition in topic["partitions"]
            if len(partition["isr"]) < len(partition["replicas"])
        ]

    def wait_fully_replicated(self, timeout_s: float) -> bool:
        """Until every replica is in sync again (a restarted node caught up); False on timeout."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.under_replicated() == []:
                return True
            time.sleep(0.5)
        return False
