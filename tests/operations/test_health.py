"""The operations endpoints of the processor and subscriber processes (no Kafka needed:
what is served, and /readyz following the readiness it is given)."""

from __future__ import annotations

import httpx

from esk.broker.ports import free_port
from esk.health import serve_operations


def test_readyz_follows_readiness_and_metrics_are_served() -> None:
    ready = [False]
    port = free_port()
    serve_operations("127.0.0.1", port, lambda: ready[0])
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=5) as client:
        assert client.get("/healthz").status_code == 200
        assert client.get("/readyz").status_code == 503
        ready[0] = True
        assert client.get("/readyz").status_code == 200
        metrics = client.get("/metrics")
        assert metrics.status_code == 200 and "esk_commands_total" in metrics.text
        assert client.get("/").status_code == 404 and client.get("/metricz").status_code == 404
