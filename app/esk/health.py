"""The operations endpoints of a process that has no HTTP API of its own (the processor,
a subscriber): `/metrics` (Prometheus), `/healthz` (the process answers, and its event loop
ran within LOOP_STALL_S), and `/readyz` (200 only while `ready()` holds: for the processor,
every assigned partition restored, rebuilt and handling commands). Served from a thread,
so they answer while the event loop is busy restoring or rebuilding a store; that thread
would answer for a loop stuck in a blocking call too, which the heartbeat tells."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

StartResponse = Callable[..., Any]


class CannotListen(Exception):
    """The operations endpoints' address is taken (another process on this host) or not
    this host's."""


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Probes every few seconds would drown the process's own log."""


# Longer than any step the loop takes between two awaits (a batch of commands, a RocksDB
# write batch), far shorter than a liveness probe's patience.
LOOP_STALL_S = 60.0


class LoopHeartbeat:
    """When the process's event loop last ran `beat`'s task: alive until it has not for
    `stall_s`, and before the loop runs it (the process waits for a broker, its topics)."""

    def __init__(self, stall_s: float = LOOP_STALL_S) -> None:
        self.stall_s = stall_s
        self.last: float | None = None

    async def beat(self) -> None:
        while True:
            self.last = time.monotonic()
            await asyncio.sleep(min(1.0, self.stall_s / 4))

    def alive(self) -> bool:
        return self.last is None or time.monotonic() - self.last < self.stall_s


def bound_socket(host: str, port: int, what: str) -> socket.socket:
    """A TCP socket bound to `host:port` for a server to listen on (uvicorn's, given it);
    CannotListen, naming `what`, when the address is taken or not this host's, rather than
    the server's own exit with a line of its log."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    bound = socket.socket(family, socket.SOCK_STREAM)
    bound.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn sets it: a restart takes the port at once
    try:
        bound.bind((host, port))
    except OSError as error:
        bound.close()
        raise CannotListen(f"cannot serve {what} on {host}:{port}: {error.strerror or error}") from None
    return bound


def serve_operations(
    host: str, port: int, ready: Callable[[], bool], metrics_of: CollectorRegistry, alive: Callable[[], bool] = lambda: True
) -> None:
    """Start the endpoints on `host:port` in a daemon thread; /metrics serves `metrics_of`,
    /healthz `alive`, /readyz `ready`. Raises CannotListen."""
    metrics = make_wsgi_app(metrics_of)

    def app(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path in ("/healthz", "/readyz"):
            ok = alive() if path == "/healthz" else ready()
            status = b'{"status":"ok"}' if ok else b'{"status":"not ready"}' if path == "/readyz" else b'{"status":"event loop stalled"}'
            start_response("200 OK" if ok else "503 Service Unavailable", [("Content-Type", "application/json")])
            return [status]
        if path != "/metrics":
            start_response("404 Not Found", [("Content-Type", "application/json")])
            return [b'{"status":"not found: /metrics, /healthz or /readyz"}']
        return metrics(environ, start_response)  # type: ignore[no-any-return]  # prometheus_client ships no hints for it

    try:
        server = make_server(host, port, app, server_class=_Server, handler_class=_QuietHandler)
    except OSError as error:
        raise CannotListen(f"cannot serve /metrics, /healthz and /readyz on {host}:{port}: {error.strerror or error}") from None
    threading.Thread(target=server.serve_forever, name="operations-http", daemon=True).start()
