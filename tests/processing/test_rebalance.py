"""Rebalancing under load: real processor processes join and leave (clean SIGTERM stops)
while commands flow over HTTP; afterwards the topics show nothing lost, duplicated or
out of order, and every revoke finished within a bound."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from bench.cluster import Cluster, EskProcess, api_ready, wait_until
from bench.crash import Load, verify
from esk.kafka.topics import ensure_topics, topic_specs
from esk.registry import load_registry
from esk.settings import Settings

pytestmark = pytest.mark.kafka

# A revoke waits for the batch in hand and one commit per partition it gives up; it must
# end well within the session timeout, or the group would drop the member meanwhile.
REVOKE_BOUND_S = 5.0


def revoke_times(processes: list[EskProcess]) -> list[float]:
    pattern = re.compile(r"gave up partitions \[[\d, ]*\] in ([\d.]+)s")
    return [float(m) for p in processes if p.log_path.exists() for m in pattern.findall(p.log_text())]


def _joins(processor: EskProcess) -> Callable[[], None]:
    """A step that starts `processor` and returns once it owns a partition: on a slow machine
    a member could otherwise leave again before its first partition was ready."""

    def step() -> None:
        owned = processor.log_text().count("ready at offset") if processor.log_path.exists() else 0
        processor.start()
        wait_until(lambda: processor.log_text().count("ready at offset") > owned, 120, f"{processor.name} to own a partition")

    return step


async def test_processors_joining_and_leaving_under_load_lose_and_duplicate_nothing(
    settings: Settings, tmp_path: Path
) -> None:
    settings = settings.model_copy(update={"topics": settings.topics.model_copy(update={"partitions": 6})})
    await ensure_topics(settings, topic_specs(settings, load_registry(settings.domain)))
    cluster = Cluster(settings, tmp_path / "cluster")
    api = cluster.api("api")
    p0, p1, p2 = (
        cluster.processor(f"p{n}", ESK_PROCESSOR__SESSION_TIMEOUT_MS="6000", ESK_PROCESSOR__STANDBY_REPLICAS="1")
        for n in range(3)
    )
    try:
        api.start()
        p0.start()
        api_url = f"http://127.0.0.1:{api.port}"
        await asyncio.to_thread(wait_until, lambda: api_ready(api_url), 60, "API ready")
        load = Load(api_url, [f"acc-{n}" for n in range(30)], rate=60, seed=7)
        driving = asyncio.create_task(load.run())
        steps = [_joins(p1), _joins(p2), p0.stop, _joins(p0), p1.stop, p2.stop]
        for step in steps:  # join, join, leave, rejoin, leave, leave: one owner left at the end
            await asyncio.sleep(4)
            await asyncio.to_thread(step)
        await asyncio.sleep(3)
        load.stop()
        await driving

        verdict = await verify(settings, api_url, load.acknowledged)
        print(verdict.notes)
        assert verdict.acknowledged > 500
        # no missing or duplicate outcome, version gap, event without its outcome, state
        # mismatch or DLQ record
        assert verdict.ok, vars(verdict)

        # every processor owned partitions at some point: partitions really moved around
        assert all("ready at offset" in p.log_text() for p in (p0, p1, p2))
        # and each said it was joining, and what each rebalance gave it
        assert all(re.search(r"joining the group \S+ for \S+'s partitions", p.log_text()) for p in (p0, p1, p2))
        assert all(re.search(r"assigned partitions \[\d", p.log_text()) for p in (p0, p1, p2))
        revokes = revoke_times([p0, p1, p2])
        print(f"{len(revokes)} revokes, longest {max(revokes):.3f}s")
        assert revokes and max(revokes) < REVOKE_BOUND_S
    finally:
        cluster.stop_all()
