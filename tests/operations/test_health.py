"""The operations endpoints of the processor and subscriber processes (no Kafka needed:
what is served, and /readyz following the readiness it is given)."""

from __future__ import annotations

import httpx
import pytest

from esk.broker.ports import free_port
from esk.health import serve_operations
from esk.metrics import Kind, exported


def test_readyz_follows_readiness_and_metrics_are_served() -> None:
    ready = [False]
    port = free_port()
    serve_operations("127.0.0.1", port, lambda: ready[0], exported(Kind.PROCESSOR))
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=5) as client:
        assert client.get("/healthz").status_code == 200
        assert client.get("/readyz").status_code == 503
        ready[0] = True
        assert client.get("/readyz").status_code == 200
        metrics = client.get("/metrics")
        assert metrics.status_code == 200 and "esk_commands_total" in metrics.text
        assert client.get("/").status_code == 404 and client.get("/metricz").status_code == 404


@pytest.mark.parametrize(
    ("kind", "own", "others"),
    [
        (Kind.PROCESSOR, "esk_active_tasks", ("esk_api_kafka_away", "esk_subscription_events_total")),
        (Kind.API, "esk_api_kafka_away", ("esk_active_tasks", "esk_commands_total", "esk_subscription_partitions")),
        (Kind.SUBSCRIBER, "esk_subscription_events_total", ("esk_active_tasks", "esk_api_kafka_away", "esk_read_model_lag")),
    ],
)
def test_each_kind_of_process_exports_its_own_metrics_and_the_process_s(kind: Kind, own: str, others: tuple[str, ...]) -> None:
    """Not the other kinds' at zero, which a dashboard counting series would take for a
    process of that kind."""
    port = free_port()
    serve_operations("127.0.0.1", port, lambda: True, exported(kind))
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    families = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}
    assert own in families and "process_cpu_seconds_total" in families, sorted(families)
    assert not set(others) & families, sorted(families)
