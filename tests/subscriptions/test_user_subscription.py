"""The promise to a new user, end to end: a subscription for their own aggregate, in their own
module, written with `import esk` alone, run with one command (`esk subscriber tally`, from
their project's directory), SIGKILLed mid-stream and started again, has applied every event
exactly once."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from aiokafka import AIOKafkaProducer

from esk.broker.ports import free_port
from esk.kafka.client_options import client_options
from esk.kafka.topics import TopicNames, ensure_topics, topic_specs
from esk.protocol import CommandEnvelope
from esk.settings import Settings
from tests.system import wait_for

pytestmark = pytest.mark.kafka

PROJECT = {
    "shop/__init__.py": "",
    "shop/counters.py": """
        from pydantic import BaseModel, Field

        from esk import AggregateType, Command, Decision, Event


        class Start(Command):
            pass


        class Add(Command):
            n: int = Field(gt=0)


        class Started(Event):
            pass


        class Added(Event):
            n: int


        class Counter(BaseModel):
            total: int = 0


        def decide(state: Counter | None, command: Command) -> Decision:
            if isinstance(command, Add):
                return [Added(n=command.n)]
            return [Started()]


        def evolve(state: Counter | None, event: Event) -> Counter:
            if isinstance(event, Added):
                assert state is not None
                return Counter(total=state.total + event.n)
            return Counter()


        counters = AggregateType(
            name="counters", state=Counter, commands={"start": Start, "add": Add}, creates=frozenset({Start}),
            events=[Started, Added], decide=decide, evolve=evolve,
        )
        AGGREGATES = [counters]
    """,
    "shop/tally.py": """
        from esk import DatabaseContext, DatabaseHandler

        from shop.counters import Added, counters

        tally = DatabaseHandler(
            "tally",
            reads=[counters],
            schema=["CREATE TABLE IF NOT EXISTS tally (counter TEXT PRIMARY KEY, events INTEGER, total INTEGER)"],
        )


        @tally.on(Added)
        async def added(event: Added, ctx: DatabaseContext) -> None:
            await ctx.db.execute(
                "INSERT INTO tally VALUES (?, 1, ?) "
                "ON CONFLICT (counter) DO UPDATE SET events = events + 1, total = total + excluded.total",
                (ctx.aggregate_id, event.n),
            )


        SUBSCRIPTIONS = [tally]
    """,
}
COUNTERS, ADDS_EACH = 20, 25


def tally(project: Path) -> dict[str, tuple[int, int]]:
    path = project / ".esk" / "subscriptions" / "tally.sqlite"
    if not path.exists():
        return {}
    with contextlib.closing(sqlite3.connect(path)) as db:
        try:
            return {counter: (events, total) for counter, events, total in db.execute("SELECT * FROM tally")}
        except sqlite3.OperationalError:  # not created yet
            return {}


async def send_commands(settings: Settings, rng: random.Random) -> dict[str, tuple[int, int]]:
    """Start every counter, then add to them at a steady pace; return what each must total."""
    expected = {f"k{n}": (0, 0) for n in range(COUNTERS)}
    producer = AIOKafkaProducer(**client_options(settings), acks="all", enable_idempotence=True)
    await producer.start()
    try:
        topic = TopicNames(settings.app).commands

        async def send(envelope: CommandEnvelope) -> None:
            await producer.send_and_wait(topic, envelope.encode(), key=envelope.key)

        for counter in expected:
            await send(CommandEnvelope(f"start-{counter}", "counters", counter, "start", {}))
        for round_ in range(ADDS_EACH):
            for counter, (events, total) in expected.items():
                n = rng.randint(1, 9)
                await send(CommandEnvelope(f"add-{counter}-{round_}", "counters", counter, "add", {"n": n}))
                expected[counter] = (events + 1, total + n)
            await asyncio.sleep(0.4)
    finally:
        await producer.stop()
    return expected


async def test_a_users_subscription_applies_every_event_once_across_kill_9(settings: Settings, tmp_path: Path) -> None:
    project = tmp_path / "my-project"
    for name, text in PROJECT.items():
        (project / name).parent.mkdir(parents=True, exist_ok=True)
        (project / name).write_text(textwrap.dedent(text))
    await ensure_topics(settings, topic_specs(settings, ["counters"]))
    env = {k: v for k, v in os.environ.items() if not k.startswith("ESK_")} | {
        "ESK_APP": settings.app,
        "ESK_KAFKA__BOOTSTRAP_SERVERS": settings.bootstrap_servers,
        "ESK_TOPICS__PARTITIONS": str(settings.topics.partitions),
        "ESK_DOMAIN": "shop.counters:AGGREGATES",
        "ESK_SUBSCRIPTIONS": "shop.tally:SUBSCRIPTIONS",
        "ESK_SUBSCRIBER__SESSION_TIMEOUT_MS": "6000",
        "ESK_PROCESSOR__METRICS_PORT": str(free_port()),
        "ESK_SUBSCRIBER__METRICS_PORT": str(free_port()),
    }

    def start(*args: str) -> subprocess.Popen[bytes]:
        log = open(project / f"{args[0]}.log", "ab")  # noqa: SIM115 - the child owns it
        return subprocess.Popen([sys.executable, "-m", "esk", *args], cwd=project, env=env, stdout=log, stderr=subprocess.STDOUT)

    processor, subscriber = start("processor"), start("subscriber", "tally")
    rng = random.Random(7)
    try:
        sending = asyncio.create_task(send_commands(settings, rng))
        for _ in range(2):
            # mid-stream: once it has applied something and while commands keep coming
            before = sum(events for events, _ in tally(project).values())
            await wait_for(lambda before=before: sum(e for e, _ in tally(project).values()) > before, 90, "the subscriber to apply events")
            await asyncio.sleep(rng.uniform(0.0, 1.0))
            subscriber.kill()
            subscriber.wait()
            subscriber = start("subscriber", "tally")
        expected = await sending
        await wait_for(lambda: tally(project) == expected, 90, "every event applied")
        await asyncio.sleep(2)  # and nothing more comes afterwards
        assert tally(project) == expected
    finally:
        for process in (processor, subscriber):
            process.terminate()
            process.wait(30)
