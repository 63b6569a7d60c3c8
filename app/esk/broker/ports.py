"""Free loopback ports, for test suites and harnesses that start their own broker and servers."""

from __future__ import annotations

import random
import socket
from pathlib import Path

from .embedded import BrokerError, port_is_free


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_port_pair() -> int:
    """A port p such that p and p+1 (the embedded broker's controller) are both free."""
    for _ in range(100):
        port = free_port()
        if port >= 65535:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no free pair of ports on 127.0.0.1")


def listening_ports(host: str, count: int) -> list[int]:
    """`count` different free ports below the kernel's ephemeral range, for brokers. A port
    from inside it (as `free_port` gives) may become the local end of some client's
    connection before a broker listens on it, or while a node is down, and then the node
    could not listen on it (again)."""
    low = _first_ephemeral_port()
    rng = random.Random()
    ports: list[int] = []
    for _ in range(10_000):
        port = rng.randrange(max(low - 12_000, 1024), low)
        if port not in ports and port_is_free(host, port):
            ports.append(port)
            if len(ports) == count:
                return ports
    raise BrokerError(f"no {count} free ports on {host} below {low}")


def _first_ephemeral_port() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default
