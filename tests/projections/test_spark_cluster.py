"""A read model on a Spark standalone cluster (a master and two workers on loopback) through
deploy/spark/submit.sh: the same Delta table as in local mode, built by tasks on both
workers, and (`make spark-cluster-test`) exactly once when Spark runs a batch again."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import pytest

pyspark = pytest.importorskip("pyspark")

from aiokafka import AIOKafkaProducer  # noqa: E402
from deltalake import DeltaTable  # noqa: E402

from esk.kafka.client_options import client_options  # noqa: E402
from esk.kafka.topics import TopicNames  # noqa: E402
from esk.projections.catalog import Tables  # noqa: E402
from esk.projections.runner import run  # noqa: E402
from esk.projections.session import spark_session  # noqa: E402
from esk.protocol import EventRecord  # noqa: E402
from esk.settings import Settings  # noqa: E402
from projections.read_models import READ_MODELS  # noqa: E402
from tests.projections.spark_cluster import SparkCluster  # noqa: E402
from tests.system import events_topic, read_topic, system  # noqa: E402

pytestmark = [pytest.mark.kafka, pytest.mark.spark]

REPO = Path(__file__).resolve().parents[2]
SUBMIT = REPO / "deploy" / "spark" / "submit.sh"
# Its events include an Opened of schema version 1, so the domain's upcaster runs in the
# executors' Python: the shipped code (esk, domain/, projections/) is imported there.
NAME = "account_balances"
PROJECTION = {p.model.name: p for p in READ_MODELS}[NAME]
# `make spark-cluster-test` also runs a batch again after a crash (another submit: a
# driver and two executors more, about a minute); `make test` leaves that out.
RERUN = os.environ.get("SPARK_CLUSTER_TEST_RERUN") == "1"
MAX_OFFSETS_PER_TRIGGER = 40  # two micro-batches (transaction markers take offsets too), so the merges compose across batches


async def _drive(settings: Settings) -> None:
    """Accounts through the API and the processor, and one event from an older release."""
    async with system(settings) as s:
        for n in range(8):
            account = f"acc-{n}"
            assert (await s.client.post(f"/v1/accounts/{account}/open", json={"owner": f"owner-{n}"})).status_code == 200
            for amount in range(1, n % 4 + 2):
                assert (await s.client.post(f"/v1/accounts/{account}/deposit", json={"amount": 10 * amount})).status_code == 200
            assert (await s.client.post(f"/v1/accounts/{account}/withdraw", json={"amount": 5})).status_code == 200
    legacy = EventRecord("accounts/legacy/1", "accounts", "legacy", 1, "Opened", 1, {"name": "old-timer"}, "x", "x", "x", 1_700_000_000_000)
    producer = AIOKafkaProducer(**client_options(settings))
    await producer.start()
    try:
        await producer.send_and_wait(TopicNames(settings.app).events("accounts"), legacy.encode(), key=b"legacy", headers=legacy.headers())
    finally:
        await producer.stop()


async def _together(*steps: Awaitable[Any]) -> list[Any]:
    """The results of `steps`, run at once; when one fails, after all have ended (none may
    go on in the background, holding a JVM, once the cluster is stopped)."""
    results = await asyncio.gather(*steps, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


def _projections(settings: Settings, **changes: object) -> Settings:
    return settings.model_copy(update={"projections": settings.projections.model_copy(update=changes)})


def _environment(cluster: SparkCluster, settings: Settings) -> dict[str, str]:
    """What a user exports before submit.sh: the settings of the application, and the Python
    that the driver and the executors run (here the suite's, which has esk's packages)."""
    return {
        **cluster.environment,
        "ESK_APP": settings.app,
        "ESK_KAFKA__BOOTSTRAP_SERVERS": settings.bootstrap_servers,
        "ESK_PROJECTIONS__WAREHOUSE_DIR": str(settings.projections.warehouse_dir),
        "ESK_PROJECTIONS__MAX_OFFSETS_PER_TRIGGER": str(MAX_OFFSETS_PER_TRIGGER),
        "PYSPARK_PYTHON": sys.executable,
    }


def _submit(cluster: SparkCluster, env: dict[str, str]) -> tuple[str, list[int]]:
    """Runs the read model once through submit.sh: the application's id, and the events of
    each micro-batch as the job reported them."""
    before = set(cluster.event_log.iterdir())
    # From the project's directory, as a user would: that is where domain/ and projections/ are.
    result = subprocess.run([str(SUBMIT), cluster.url, NAME], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-5000:]
    [log] = set(cluster.event_log.iterdir()) - before
    batches = [int(n.replace(",", "")) for n in re.findall(rf"{NAME} g1 batch \d+: ([\d,]+) events", result.stdout + result.stderr)]
    return log.name, batches


def _run_locally(settings: Settings) -> int:
    """The read model in local mode (as `esk project run` builds it): the events it read."""
    spark = spark_session(settings, "esk-tests-local")
    try:
        return run(settings, PROJECTION, spark=spark).events
    finally:
        spark.stop()


def _rows(warehouse: Path) -> list[dict[str, Any]]:
    path = Tables(warehouse).current_path(NAME)
    assert path is not None
    return sorted(DeltaTable(str(path)).to_pyarrow_table().to_pylist(), key=lambda row: row["account_id"])


# Three JVMs for the cluster, a driver and two executors per run, and local mode: about
# four minutes on two cores shared with other work.
@pytest.mark.timeout(900)
async def test_a_read_model_on_a_two_worker_cluster_equals_local_mode_exactly_once(settings: Settings, tmp_path: Path) -> None:
    cluster = SparkCluster(tmp_path / "spark")
    # The JVMs start while the commands run; neither waits for the other.
    try:
        await _together(asyncio.to_thread(cluster.start), _drive(settings))
        events = len(await read_topic(settings, events_topic(settings, "accounts")))

        # On one machine, a tmp path is one that every worker sees.
        shared = _projections(settings, warehouse_dir=tmp_path / "shared" / "warehouse", max_offsets_per_trigger=MAX_OFFSETS_PER_TRIGGER)
        env = _environment(cluster, shared)
        local = _projections(shared, warehouse_dir=tmp_path / "local")
        # Both runs wait mostly on JVMs starting and on Spark's scheduling, so they overlap.
        (app, batches), local_events = await _together(asyncio.to_thread(_submit, cluster, env), asyncio.to_thread(_run_locally, local))
        assert len(batches) > 1 and sum(batches) == events == local_events
        tasks = cluster.tasks_per_worker(app)
        assert len(tasks) == 2 and all(tasks.values()), tasks
        on_cluster = _rows(shared.projections.warehouse_dir)
        assert on_cluster == _rows(local.projections.warehouse_dir)
        assert {"account_id": "legacy", "owner": "old-timer", "balance": 0, "status": "open", "version": 1} in on_cluster

        if not RERUN:
            return
        # A crash after the last batch's Delta commit, before Spark recorded the batch as
        # done: on the cluster too, the batch runs again and Delta skips its writes (in local
        # mode tests/projections/test_read_models.py proves the same in every run of the suite).
        tables = Tables(shared.projections.warehouse_dir)
        table_path = tables.current_path(NAME)
        version = DeltaTable(str(table_path)).version()
        commits = tables.checkpoint(NAME, 1) / "commits"
        last = max((p for p in commits.iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
        last.unlink()
        (commits / f".{last.name}.crc").unlink(missing_ok=True)
        _, again = _submit(cluster, env)
        assert again == [batches[-1]]  # it really ran again
        assert DeltaTable(str(table_path)).version() == version
        assert _rows(shared.projections.warehouse_dir) == on_cluster
    finally:
        cluster.stop()
