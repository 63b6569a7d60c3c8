"""Free loopback ports, for test suites and harnesses that start their own broker and servers."""

from __future__ import annotations

import socket


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
