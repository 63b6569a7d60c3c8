"""Free loopback ports, for test suites and harnesses that start their own broker and servers."""

from __future__ import annotations

import random
from pathlib import Path

from .embedded import BrokerError, port_is_free


def free_port(host: str = "127.0.0.1") -> int:
    """A free port for a server, below the kernel's ephemeral range (`listening_ports` says
    why)."""
    return _free_run(host, 1)


def free_port_pair(host: str = "127.0.0.1") -> int:
    """A port p such that p and p+1 (the embedded broker's controller) are both free, below
    the kernel's ephemeral range."""
    return _free_run(host, 2)


def listening_ports(host: str, count: int) -> list[int]:
    """`count` different free ports below the kernel's ephemeral range, for brokers. A port
    from inside it (as binding port 0 gives) may become the local end of some client's
    connection before a server listens on it, or while a server is down, and then the
    server could not listen on it (again)."""
    ports: list[int] = []
    for _ in range(10_000):
        port = _free_run(host, 1)
        if port not in ports:
            ports.append(port)
            if len(ports) == count:
                return ports
    raise BrokerError(f"no {count} free ports on {host} below {_first_ephemeral_port()}")


def _free_run(host: str, length: int) -> int:
    """The first of `length` consecutive free ports below the ephemeral range, picked at
    random (two test processes picking at once rarely meet)."""
    low = _first_ephemeral_port()
    rng = random.Random()
    for _ in range(10_000):
        port = rng.randrange(max(low - 12_000, 1024), low - length + 1)
        if all(port_is_free(host, port + i) for i in range(length)):
            return port
    raise BrokerError(f"no {length} free consecutive ports on {host} below {low}")


def _first_ephemeral_port() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default
