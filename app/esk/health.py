"""The operations endpoints of a process that has no HTTP API of its own (the processor,
a subscriber): `/metrics` (Prometheus), `/healthz` (the process answers), and `/readyz`
(200 only while `ready()` holds: for the processor, every assigned partition restored,
rebuilt and handling commands). Served from a thread, so they answer while the event loop
is busy restoring or rebuilding a store."""

from __future__ import annotations

import threading
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


def serve_operations(host: str, port: int, ready: Callable[[], bool], metrics_of: CollectorRegistry) -> None:
    """Start the endpoints on `host:port` in a daemon thread; /metrics serves `metrics_of`.
    Raises CannotListen."""
    metrics = make_wsgi_app(metrics_of)

    def app(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path in ("/healthz", "/readyz"):
            ok = path == "/healthz" or ready()
            start_response("200 OK" if ok else "503 Service Unavailable", [("Content-Type", "application/json")])
            return [b'{"status":"ok"}' if ok else b'{"status":"not ready"}']
        if path != "/metrics":
            start_response("404 Not Found", [("Content-Type", "application/json")])
            return [b'{"status":"not found: /metrics, /healthz or /readyz"}']
        return metrics(environ, start_response)  # type: ignore[no-any-return]  # prometheus_client ships no hints for it

    try:
        server = make_server(host, port, app, server_class=_Server, handler_class=_QuietHandler)
    except OSError as error:
        raise CannotListen(f"cannot serve /metrics, /healthz and /readyz on {host}:{port}: {error.strerror or error}") from None
    threading.Thread(target=server.serve_forever, name="operations-http", daemon=True).start()
