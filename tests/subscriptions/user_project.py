"""A new user's project, as the subscription tests write it: their own aggregate type
(`shop.counters`) and subscriptions, run by `python -m esk` from the project's directory
against the suite's broker, and the commands they send."""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

from aiokafka import AIOKafkaProducer

from esk.kafka.client_options import client_options
from esk.kafka.topics import TopicNames, ensure_topics, topic_specs
from esk.protocol import CommandEnvelope
from esk.settings import Settings

# The project's domain module: the same counters the in-process tests use (tests/counters.py),
# written into the project as its own file.
COUNTERS_MODULE = (Path(__file__).parent.parent / "counters.py").read_text()


class UserProject:
    """A project directory with the user's modules, and its esk processes."""

    def __init__(self, root: Path, settings: Settings, modules: dict[str, str], env: dict[str, str]) -> None:
        self.root = root
        self.settings = settings
        for name, text in {"shop/__init__.py": "", "shop/counters.py": COUNTERS_MODULE, **modules}.items():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            (root / name).write_text(textwrap.dedent(text))
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("ESK_")} | {
            "ESK_APP": settings.app,
            "ESK_KAFKA__BOOTSTRAP_SERVERS": settings.bootstrap_servers,
            "ESK_TOPICS__PARTITIONS": str(settings.topics.partitions),
            "ESK_DOMAIN": "shop.counters:AGGREGATES",
            "ESK_SUBSCRIBER__SESSION_TIMEOUT_MS": "6000",
            # any free port: a test may run several subscribers of one project
            "ESK_PROCESSOR__METRICS_PORT": "0",
            "ESK_SUBSCRIBER__METRICS_PORT": "0",
        } | env

    async def create_topics(self) -> None:
        await ensure_topics(self.settings, topic_specs(self.settings, ["counters"]))

    def start(self, *args: str, log_name: str | None = None) -> subprocess.Popen[bytes]:
        """`esk ARGS` in the project's directory, its output appended to `<log_name>.log`."""
        log = open(self.root / f"{log_name or args[0]}.log", "ab")  # noqa: SIM115 - the child owns it
        return subprocess.Popen([sys.executable, "-m", "esk", *args], cwd=self.root, env=self.env, stdout=log, stderr=subprocess.STDOUT)

    def log(self, name: str) -> str:
        return (self.root / f"{name}.log").read_text(errors="replace")


async def send_counter_commands(
    settings: Settings, rng: random.Random, counters: int, adds_each: int, pause_s: float
) -> dict[str, tuple[int, int]]:
    """Start every counter, then add to each in rounds, `pause_s` apart; return each
    counter's expected (number of additions, total)."""
    expected = {f"k{n}": (0, 0) for n in range(counters)}
    producer = AIOKafkaProducer(**client_options(settings), acks="all", enable_idempotence=True)
    await producer.start()
    try:
        topic = TopicNames(settings.app).commands

        async def send(envelope: CommandEnvelope) -> None:
            await producer.send_and_wait(topic, envelope.encode(), key=envelope.key)

        for counter in expected:
            await send(CommandEnvelope(f"start-{counter}", "counters", counter, "start", {}))
        for round_ in range(adds_each):
            for counter, (events, total) in expected.items():
                n = rng.randint(1, 9)
                await send(CommandEnvelope(f"add-{counter}-{round_}", "counters", counter, "add", {"n": n}))
                expected[counter] = (events + 1, total + n)
            await asyncio.sleep(pause_s)
    finally:
        await producer.stop()
    return expected
