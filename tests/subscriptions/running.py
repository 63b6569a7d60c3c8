"""A subscription's runner inside the test's event loop, against the suite's broker."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from esk.registry import Registry
from esk.settings import Settings
from esk.subscriptions.api import AnySubscription
from esk.subscriptions.runner import SubscriptionRunner
from tests.system import wait_for


def subscriber_settings(settings: Settings, data_dir: Path) -> Settings:
    """No metrics server (several runners share the test's process), and databases under the test's directory."""
    return settings.model_copy(
        update={"subscriber": settings.subscriber.model_copy(update={"data_dir": data_dir, "metrics_port": None})}
    )


@dataclass
class RunningSubscriber:
    runner: SubscriptionRunner
    stop: asyncio.Event
    task: asyncio.Task[None]

    async def caught_up(self, timeout_s: float = 60) -> None:
        await wait_for(lambda: self.runner.caught_up or self.task.done(), timeout_s, f"{self.runner.subscription.name} to catch up")
        if self.task.done():
            self.task.result()

    async def shutdown(self) -> None:
        self.stop.set()
        await asyncio.wait_for(self.task, 60)


@asynccontextmanager
async def subscriber(settings: Settings, subscription: AnySubscription, registry: Registry) -> AsyncIterator[RunningSubscriber]:
    runner = SubscriptionRunner(settings, subscription, registry)
    stop = asyncio.Event()
    running = RunningSubscriber(runner, stop, asyncio.create_task(runner.run(stop)))
    try:
        yield running
    finally:
        if not running.task.done():
            await running.shutdown()
