"""Free loopback ports, for test suites and harnesses that start their own broker and servers."""

from __future__ import annotations

import random
from pathlib import Path

from .embedded import BrokerError, port_is_free


def free_port(host: str = "127.0.0.1") -> int:
    """A free port for a server, outside the kernel's ephemeral range (`listening_ports` says
    why)."""
    return _free_run(host, 1)


def free_port_pair(host: str = "127.0.0.1") -> int:
    """A port p such that p and p+1 (the embedded broker's controller) are both free, outside
    the kernel's ephemeral range."""
    return _free_run(host, 2)


def listening_ports(host: str, count: int) -> list[int]:
    """`count` different free ports outside the kernel's ephemeral range, for brokers. A port
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
    raise BrokerError(f"no {count} free ports on {host} outside the ephemeral range {_ephemeral_range()}")


def _free_run(host: str, length: int) -> int:
    """The first of `length` consecutive free ports outside the ephemeral range, picked at
    random (two test processes picking at once rarely meet)."""
    first, last = _ephemeral_range()
    rng = random.Random()
    for _ in range(10_000):
        port = rng.choice(_server_ranges(first, last, length))
        if all(port_is_free(host, port + i) for i in range(length)):
            return port
    raise BrokerError(f"no {length} free consecutive ports on {host} outside {first}-{last}")


def _server_ranges(first: int, last: int, length: int) -> range:
    """Where a run of `length` ports for servers is drawn from: up to 12,000 ports below
    the ephemeral range `first`-`last`, else above it; a host whose range leaves no room on
    either side (some are tuned to 1024-65535) draws from all of them, and lives with the
    rare collision."""
    below = range(max(first - 12_000, 1024), first - length + 1)
    above = range(last + 1, min(last + 12_001, 65_537 - length))
    room = max(below, above, key=len)
    return room if len(room) >= 1_000 else range(1024, 65_537 - length)


def _ephemeral_range() -> tuple[int, int]:
    try:
        first, last = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[:2]
        return int(first), int(last)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default
