"""The broker-failure harness: a three-node Kafka cluster, one processor, one API and the
example's two subscribers, HTTP load from careful clients, and a random broker SIGKILLed
and restarted again and again; then a check, from the topics themselves, that nothing was
lost, duplicated or left with a gap, and that esk's processes lived through it.

    python -m bench.cluster_kill --minutes 5          (make cluster-test)

The cluster (esk.broker.cluster.KafkaCluster) runs from esk's own Kafka jars, every node broker
and controller at once; esk's topics have replication factor 3 and min.insync.replicas 2,
so losing any one node must cost neither an acknowledged command nor availability for
longer than a leader election.

The clients are careful: each command carries an Idempotency-Key, and a 5xx answer, a
timeout or a broken connection is retried with the same key until a final answer (or a
deadline, which counts as a violation: something hung). Before each kill the harness
waits until every replica is in sync again, so that one node at a time is ever missing.
Meanwhile it asks the API's and the processor's /readyz twice a second, and reads an
account from the API each time it says ready.

The verdict (exit code 1 when any violation):
- bench.crash's checks on the topics, read_committed: every acknowledged command has
  exactly one outcome; each account's events are versions 1..n, exactly those of the
  accepted outcomes; the state the API serves is the fold of the events; the DLQ is empty;
- every version a client was answered is its command's outcome on the topic;
- no command given up, no answer a valid command should never get;
- /readyz always answered (API and processor), an API that said ready did serve reads,
  and both are ready at the end;
- the processor and the API never exited, and the processor owns every partition at the end;
- the subscribers (fed by orders placed over HTTP, most of them paid from an account by
  the `payments` saga) never exited, caught up at the end, and pass bench.subscriptions_crash's
  checks: the ledger equals the orders' events, every order to be paid from an account
  paid or cancelled exactly once.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import re
import shutil
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import orjson
from rich.console import Console
from rich.table import Table

from bench import subscriptions_crash
from bench.cluster import Cluster, EskProcess, exit_with, run_harness
from bench.crash import Verdict, count_rows, verdict_table, verify
from esk.broker import BrokerError
from esk.broker.cluster import KafkaCluster
from esk.kafka.reader import read_committed
from esk.kafka.topics import TopicNames, ensure_topics, topic_specs
from esk.registry import load_registry
from esk.settings import Settings
from esk.subscriptions.catalog import load_subscriptions
from esk.subscriptions.operations import SubscriptionOperations

REPLICATION_FACTOR = 3
MIN_INSYNC_REPLICAS = 2
AFTER_THE_LAST_KILL_S = 5.0


class CarefulClients:
    """Clients that each send commands one after another at a steady pace, and retry a
    command with the same Idempotency-Key until it gets a final answer."""

    def __init__(
        self,
        api_url: str,
        accounts: list[str],
        rate: float,
        clients: int,
        seed: int,
        attempt_timeout_s: float = 15.0,
        deadline_s: float = 120.0,
    ) -> None:
        self.api_url = api_url
        self.accounts = accounts
        self.rate = rate
        self.clients = clients
        self.rng = random.Random(seed)
        self.attempt_timeout_s = attempt_timeout_s
        self.deadline_s = deadline_s
        self.sent = 0
        self.acknowledged: set[str] = set()
        self.opened: list[str] = []
        self.answered_versions: dict[str, int] = {}  # command id -> the version its 200 answer named
        self.rejections: Counter[str] = Counter()
        self.retries: Counter[str] = Counter()  # why an attempt was retried
        self.retried: set[str] = set()  # commands sent more than once
        self.given_up: list[str] = []
        self.unexpected: Counter[str] = Counter()
        self.latencies: list[float] = []  # seconds from a command's first attempt to its final answer
        self.answered_at: list[float] = []  # monotonic time of every final answer
        self._stop = asyncio.Event()

    async def run(self) -> None:
        limits = httpx.Limits(max_connections=self.clients + 4, max_keepalive_connections=self.clients + 4)
        async with httpx.AsyncClient(base_url=self.api_url, limits=limits) as http:
            await asyncio.gather(*(self._client(http, n) for n in range(self.clients)))

    def stop(self) -> None:
        """The clients finish the command in hand, retries included, and send no other."""
        self._stop.set()

    async def _client(self, http: httpx.AsyncClient, number: int) -> None:
        for account in self.accounts[number :: self.clients]:
            if await self.submit(http, account, "open", {"owner": account}, f"open-{account}") == 200:
                self.opened.append(account)
        interval = self.clients / self.rate
        next_at = time.monotonic()
        while not self._stop.is_set():
            if self.opened:
                account = self.rng.choice(self.opened)
                command = self.rng.choice(["deposit", "deposit", "deposit", "withdraw", "withdraw"])
                await self.submit(http, account, command, {"amount": self.rng.randint(1, 100)}, uuid.uuid4().hex)
            next_at = max(next_at + interval, time.monotonic())
            await asyncio.sleep(next_at - time.monotonic())

    async def submit(self, http: httpx.AsyncClient, account: str, command: str, body: object, command_id: str) -> int | None:
        """Send one command until it has a final answer; its HTTP status (None: given up)."""
        self.sent += 1
        started = time.monotonic()
        while True:
            try:
                response = await http.post(
                    f"/v1/accounts/{account}/{command}",
                    json=body,
                    headers={"Idempotency-Key": command_id},
                    timeout=self.attempt_timeout_s,
                )
            except httpx.TimeoutException:
                cause = "timeout"
            except httpx.TransportError as error:
                cause = type(error).__name__
            else:
                problem = _problem(response)
                if response.status_code == 503 and problem.get("code") == "outcome_pending":
                    self.acknowledged.add(command_id)  # stored: its outcome will come
                if response.status_code < 500:
                    self._final(command_id, response, problem)
                    self.answered_at.append(time.monotonic())
                    self.latencies.append(self.answered_at[-1] - started)
                    return response.status_code
                cause = f"{response.status_code} {problem.get('code', '')}".strip()
            self.retries[cause] += 1
            self.retried.add(command_id)
            if time.monotonic() - started > self.deadline_s:
                self.given_up.append(command_id)
                return None
            await asyncio.sleep(0.5)

    def _final(self, command_id: str, response: httpx.Response, problem: dict[str, object]) -> None:
        if response.status_code == 200:
            self.acknowledged.add(command_id)
            self.answered_versions[command_id] = int(response.json()["version"])
        elif "command_id" in problem:  # refused by the processor: an outcome all the same
            self.acknowledged.add(command_id)
            self.rejections[str(problem.get("code"))] += 1
        else:  # refused by the API itself: a valid command never should be
            self.unexpected[f"{response.status_code} {problem.get('code', '')}"] += 1


def _problem(response: httpx.Response) -> dict[str, object]:
    if not response.headers.get("content-type", "").startswith("application/problem+json"):
        return {}
    try:
        body = response.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


@dataclass
class Readiness:
    """What a process's /readyz said, sampled; for the API, also whether it served a read
    each time it said ready."""

    ready: int = 0
    not_ready: int = 0
    unanswered: int = 0
    ready_but_not_serving: int = 0

    async def sample(self, url: str, stop: asyncio.Event, readable: list[str] | None = None, every_s: float = 0.5) -> None:
        """Until `stop`; `readable`: accounts that exist (filled as they are opened), one
        of which is read after each ready answer."""
        rng = random.Random()
        # Seconds, not milliseconds: a busy machine may keep a process off the CPU for a
        # while; what is not answered in time is hung.
        async with httpx.AsyncClient(base_url=url, timeout=5.0) as http:
            while not stop.is_set():
                try:
                    answer = await http.get("/readyz")
                except httpx.HTTPError:
                    self.unanswered += 1
                else:
                    if answer.status_code != 200:
                        self.not_ready += 1
                    else:
                        self.ready += 1
                        if readable and not await _serves(http, rng.choice(readable)):
                            self.ready_but_not_serving += 1
                await asyncio.sleep(every_s)


async def _serves(http: httpx.AsyncClient, account: str) -> bool:
    try:
        return (await http.get(f"/v1/accounts/{account}")).status_code == 200
    except httpx.HTTPError:
        return False


@dataclass(frozen=True)
class KillSchedule:
    """When brokers die: one at a time, `every_s` after the previous one came back, each
    down for `down_s`; `kills` of them however long that takes, or as many as fit in
    `duration_s`, the least time the load runs."""

    duration_s: float
    every_s: float = 20.0
    down_s: float = 5.0
    kills: int | None = None

    def another(self, done: int, until: float) -> bool:
        if self.kills is not None:
            return done < self.kills
        return time.monotonic() + self.every_s < until


@dataclass(frozen=True)
class Workload:
    rate: float = 100  # accounts commands per second, all careful clients together
    clients: int = 32
    accounts: int = 300
    partitions: int = 6
    order_rate: float = 5  # orders per second for the subscribers (0: no subscribers)
    seed: int = 1


@dataclass
class BrokerKill:
    node: int
    at_s: float  # since the load began
    restart_s: float | None  # from the restart until the node answered (None: it did not)
    resync_s: float | None  # until every replica was in sync again, before this kill (None: not in time)


async def kill_brokers(
    kafka: KafkaCluster, schedule: KillSchedule, started: float, rng: random.Random, console: Console
) -> list[BrokerKill]:
    """Kill nodes as `schedule` says: each once every replica is in sync again (so one node
    at a time is ever missing), restarted on its own data."""
    kills: list[BrokerKill] = []
    while schedule.another(len(kills), started + schedule.duration_s):
        await asyncio.sleep(schedule.every_s)
        waited = time.monotonic()
        in_sync = await asyncio.to_thread(kafka.wait_fully_replicated, 120)
        resync_s = time.monotonic() - waited if in_sync else None
        node = rng.choice(sorted(kafka.nodes))
        await asyncio.to_thread(kafka.kill, node)
        at_s = time.monotonic() - started
        await asyncio.sleep(schedule.down_s)
        restarting = time.monotonic()
        try:
            await asyncio.to_thread(kafka.start, node)
            restart_s: float | None = time.monotonic() - restarting
        except BrokerError as error:
            console.print(f"[red]node {node} did not restart: {error}[/red]")
            restart_s = None
        kills.append(BrokerKill(node, at_s, restart_s, resync_s))
        restarted = f"answered {restart_s:.1f}s after its restart" if restart_s is not None else "did not come back"
        console.print(
            f"kill {len(kills)} at {at_s:.0f}s: node {node} SIGKILLed, down {schedule.down_s:.0f}s, {restarted}",
            highlight=False,
        )
    return kills


class Subscribers:
    """The example's subscribers as processes (`customer_ledger`, a database handler, and
    `payments`, a reactor that sends commands), fed by orders over HTTP and checked as
    bench.subscriptions_crash checks them."""

    NAMES = ("customer_ledger", "payments")

    def __init__(
        self, esk: Cluster, settings: Settings, workdir: Path, api_url: str, rate: float, seed: int, env: dict[str, str]
    ) -> None:
        self.api_url = api_url
        data_dir = workdir / "subscriptions"
        self.ledger_path = data_dir / "customer_ledger.sqlite"
        # what the checks read: the subscribers' databases, not the current directory's
        self.settings = settings.model_copy(update={"subscriber": settings.subscriber.model_copy(update={"data_dir": data_dir})})
        self.processes = [esk.subscriber(name, name, data_dir, **env) for name in self.NAMES]
        self.funded, self.empty, self.closed = [f"funded-{n}" for n in range(5)], ["empty-0"], ["closed-0"]
        payers = [*self.funded, *self.funded, *self.empty, *self.closed, "unknown-0"]
        self.load = subscriptions_crash.OrderLoad(api_url, payers, rate, seed)
        self._driving: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """The accounts orders are paid from, then the subscribers and the orders."""
        async with httpx.AsyncClient(base_url=self.api_url, timeout=30) as http:
            await subscriptions_crash.prepare_accounts(http, self.funded, self.empty, self.closed)
        for process in self.processes:
            process.start()
        self._driving = asyncio.create_task(self.load.run())

    async def stop_load(self) -> None:
        self.load.stop()
        if self._driving is not None:
            await self._driving

    async def verify(self) -> subscriptions_crash.Verdict | None:
        """Once every order's outcome is in and the subscribers caught up: their checks
        (None: they did not catch up)."""
        await subscriptions_crash.wait_for_outcomes(self.settings, self.load.acknowledged)
        subscriptions = load_subscriptions(self.settings.subscriptions)
        registry = load_registry(self.settings.domain)
        operations = [SubscriptionOperations(self.settings, subscriptions[name], registry) for name in self.NAMES]
        try:
            await subscriptions_crash.wait_until_settled(self.settings, operations)
        except TimeoutError:
            return None
        verdict = await subscriptions_crash.verify(self.settings, self.api_url, self.ledger_path, self.funded, operations)
        verdict.acknowledged = len(self.load.acknowledged)
        verdict.subscriber_starts = sum(p.starts for p in self.processes)
        return verdict

    @property
    def exits(self) -> int:
        return sum(p.starts - 1 + int(not p.alive) for p in self.processes)


@dataclass
class ClusterKillVerdict:
    topics: Verdict
    broker_kills: int = 0
    broker_restarts_failed: int = 0
    replicas_not_in_sync_before_a_kill: int = 0
    commands_sent: int = 0
    attempts_retried: int = 0
    commands_given_up: int = 0
    unexpected_answers: int = 0
    answers_contradicting_outcomes: int = 0
    api_readyz_ready: int = 0
    api_readyz_not_ready: int = 0
    api_readyz_unanswered: int = 0
    api_readyz_ready_but_not_serving: int = 0
    api_not_ready_at_end: int = 0
    processor_readyz_ready: int = 0
    processor_readyz_not_ready: int = 0
    processor_readyz_unanswered: int = 0
    processor_not_ready_at_end: int = 0
    processor_exits: int = 0
    api_exits: int = 0
    partitions_not_owned_at_end: int = 0
    subscriber_exits: int = 0
    subscribers_not_caught_up: int = 0
    subscriptions: subscriptions_crash.Verdict | None = None  # None: run without subscribers
    notes: list[str] = field(default_factory=list)

    @property
    def violations(self) -> int:
        return (
            self.broker_restarts_failed
            + self.commands_given_up
            + self.unexpected_answers
            + self.answers_contradicting_outcomes
            + self.api_readyz_unanswered
            + self.api_readyz_ready_but_not_serving
            + self.api_not_ready_at_end
            + self.processor_readyz_unanswered
            + self.processor_not_ready_at_end
            + self.processor_exits
            + self.api_exits
            + self.partitions_not_owned_at_end
            + self.subscriber_exits
            + self.subscribers_not_caught_up
        )

    @property
    def ok(self) -> bool:
        subscriptions_ok = self.subscriptions is None or self.subscriptions.ok
        return self.topics.ok and subscriptions_ok and self.violations == 0

    def table(self, title: str) -> Table:
        subscriptions = count_rows(self.subscriptions, "subscriptions: ") if self.subscriptions is not None else []
        return verdict_table(title, count_rows(self.topics) + count_rows(self) + subscriptions, self.ok)


async def run(kafka: KafkaCluster, workdir: Path, schedule: KillSchedule, workload: Workload, console: Console) -> ClusterKillVerdict:
    settings = Settings(
        app=f"kill{uuid.uuid4().hex[:6]}",
        kafka={"bootstrap_servers": kafka.bootstrap},
        topics={
            "partitions": workload.partitions,
            "replication_factor": REPLICATION_FACTOR,
            "min_insync_replicas": MIN_INSYNC_REPLICAS,
        },
        _env_file=None,
    )
    report = await ensure_topics(settings, topic_specs(settings, load_registry(settings.domain)))
    if report.problems:
        raise RuntimeError(report.problems)
    topic_env = {
        "ESK_TOPICS__REPLICATION_FACTOR": str(REPLICATION_FACTOR),
        "ESK_TOPICS__MIN_INSYNC_REPLICAS": str(MIN_INSYNC_REPLICAS),
    }
    esk = Cluster(settings, workdir)
    api = esk.api("api", **topic_env)
    processor = esk.processor("processor", **topic_env)
    console.print(f"app {settings.app} on {kafka.bootstrap}; logs in {workdir}", highlight=False)
    try:
        await asyncio.to_thread(esk.start_all)
        subscribers = None
        if workload.order_rate > 0:
            subscribers = Subscribers(esk, settings, workdir, api.url, workload.order_rate, workload.seed, topic_env)
            await subscribers.start()
        accounts = [f"acc-{n}" for n in range(workload.accounts)]
        load = CarefulClients(api.url, accounts, workload.rate, workload.clients, workload.seed)
        sampling_stop = asyncio.Event()
        api_readiness, processor_readiness = Readiness(), Readiness()
        sampling = [
            asyncio.create_task(api_readiness.sample(api.url, sampling_stop, load.opened)),
            asyncio.create_task(processor_readiness.sample(processor.url, sampling_stop)),
        ]
        driving = asyncio.create_task(load.run())
        started = time.monotonic()
        kills = await kill_brokers(kafka, schedule, started, random.Random(workload.seed), console)
        # the load goes on for a while after the last node came back: esk must be working again
        await asyncio.sleep(max(started + schedule.duration_s - time.monotonic(), AFTER_THE_LAST_KILL_S))
        load.stop()
        await driving
        if subscribers is not None:
            await subscribers.stop_load()
        await asyncio.to_thread(kafka.wait_fully_replicated, 120)
        sampling_stop.set()
        await asyncio.gather(*sampling)

        # The saga's commands settle first: the topics' check reads the outcomes, then the
        # events, and a withdrawal handled in between would look like a mismatch.
        subscriptions = await subscribers.verify() if subscribers is not None else None
        verdict = ClusterKillVerdict(await verify(settings, api.url, load.acknowledged, retried=load.retried))
        verdict.broker_kills = len(kills)
        verdict.broker_restarts_failed = sum(k.restart_s is None for k in kills)
        verdict.replicas_not_in_sync_before_a_kill = sum(k.resync_s is None for k in kills)
        verdict.commands_sent = load.sent
        verdict.attempts_retried = sum(load.retries.values())
        verdict.commands_given_up = len(load.given_up)
        verdict.unexpected_answers = sum(load.unexpected.values())
        verdict.answers_contradicting_outcomes = await _answers_contradicting_outcomes(settings, load.answered_versions)
        verdict.api_readyz_ready = api_readiness.ready
        verdict.api_readyz_not_ready = api_readiness.not_ready
        verdict.api_readyz_unanswered = api_readiness.unanswered
        verdict.api_readyz_ready_but_not_serving = api_readiness.ready_but_not_serving
        verdict.api_not_ready_at_end = int(not await _ready(api.url))
        verdict.processor_readyz_ready = processor_readiness.ready
        verdict.processor_readyz_not_ready = processor_readiness.not_ready
        verdict.processor_readyz_unanswered = processor_readiness.unanswered
        verdict.processor_not_ready_at_end = int(not await _ready(processor.url))
        verdict.processor_exits = processor.starts - 1 + int(not processor.alive)
        verdict.api_exits = api.starts - 1 + int(not api.alive)
        owned = await asyncio.to_thread(processor.metric, "esk_active_tasks")
        verdict.partitions_not_owned_at_end = workload.partitions - int(owned or 0)
        verdict.notes += _notes(load, kills, processor, api)
        verdict.notes += verdict.topics.notes
        if subscribers is not None:
            verdict.subscriptions = subscriptions
            verdict.subscribers_not_caught_up = int(verdict.subscriptions is None)
            verdict.subscriber_exits = subscribers.exits
            verdict.notes.append(f"orders not acknowledged (never retried): {dict(subscribers.load.refused)}")
            verdict.notes += verdict.subscriptions.notes if verdict.subscriptions is not None else []
        return verdict
    finally:
        esk.stop_all()


async def _answers_contradicting_outcomes(settings: Settings, answered_versions: dict[str, int]) -> int:
    """Commands whose 200 answer named another version than their outcome on the results topic."""
    outcomes = {}
    for record in await read_committed(settings, TopicNames(settings.app).results):
        outcome = orjson.loads(record.value)
        outcomes[outcome["command_id"]] = outcome.get("version")
    return sum(1 for command_id, version in answered_versions.items() if outcomes.get(command_id) != version)


async def _ready(api_url: str) -> bool:
    async with httpx.AsyncClient(base_url=api_url, timeout=5.0) as http:
        try:
            return (await http.get("/readyz")).status_code == 200
        except httpx.HTTPError:
            return False


# Log lines of esk's processes that show how they rode out a broker's death.
_RIDE_OUT = {
    "processor: commits failed and partitions restarted": re.compile(r"commit failed .*; restarting its task"),
    "processor: task starts tried again": re.compile(r"could not start its task"),
    "processor: partitions given up as fenced": re.compile(r"fenced by a newer owner"),
    "api: commands not stored (503 kafka_unavailable)": re.compile(r"could not submit command"),
}


def _notes(load: CarefulClients, kills: list[BrokerKill], processor: EskProcess, api: EskProcess) -> list[str]:
    latencies = sorted(load.latencies) or [0.0]
    answered = sorted(load.answered_at)
    longest_silence = max((later - earlier for earlier, later in itertools.pairwise(answered)), default=0.0)
    resyncs = [k.resync_s for k in kills if k.resync_s is not None]
    restarts = [k.restart_s for k in kills if k.restart_s is not None]
    notes = [
        f"nodes killed: {dict(sorted(Counter(k.node for k in kills).items()))}; restart to answering: "
        f"max {max(restarts, default=0):.1f}s; waiting for replicas in sync before a kill: max {max(resyncs, default=0):.1f}s",
        f"answers: {len(load.acknowledged):,} acknowledged, rejections {dict(load.rejections)}, "
        f"unexpected {dict(load.unexpected)}",
        f"retried attempts by cause: {dict(load.retries.most_common())}",
        f"time to a final answer: median {latencies[len(latencies) // 2]:.2f}s, "
        f"p99 {latencies[int(len(latencies) * 0.99)]:.2f}s, max {latencies[-1]:.2f}s; "
        f"longest time without any final answer: {longest_silence:.1f}s",
    ]
    logs = {"processor": processor.log_text(), "api": api.log_text()}
    for what, pattern in _RIDE_OUT.items():
        notes.append(f"{what}: {len(pattern.findall(logs[what.split(':')[0]]))}")
    if load.given_up:
        notes.append(f"given up (first 10): {load.given_up[:10]}")
    return notes


@asynccontextmanager
async def scratch_kafka_cluster(prefix: str, heap: str = "384m") -> AsyncIterator[KafkaCluster]:
    """A three-node cluster of its own (free ports, a fresh directory); stopped and removed afterwards."""
    data_dir = Path(tempfile.mkdtemp(prefix=f"{prefix}-kafka-"))
    kafka = KafkaCluster(data_dir, heap=heap)
    try:
        await asyncio.to_thread(kafka.start)
        yield kafka
    finally:
        await asyncio.to_thread(kafka.stop)
        shutil.rmtree(data_dir, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=5, help="how long the load runs, kills included")
    parser.add_argument("--kills", type=int, default=None, help="that many kills, however long they take")
    parser.add_argument("--kill-every", type=float, default=20, help="seconds from a restart to the next kill")
    parser.add_argument("--down", type=float, default=5, help="seconds a killed node stays down")
    parser.add_argument("--rate", type=float, default=100, help="commands per second, all clients together")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--accounts", type=int, default=300)
    parser.add_argument("--partitions", type=int, default=6)
    parser.add_argument("--orders", type=float, default=5, help="orders per second for the subscribers (0: no subscribers)")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    schedule = KillSchedule(args.minutes * 60, args.kill_every, args.down, args.kills)
    workload = Workload(args.rate, args.clients, args.accounts, args.partitions, args.orders, args.seed)
    console = Console()

    async def harness() -> ClusterKillVerdict:
        async with scratch_kafka_cluster("esk-cluster-kill") as kafka:
            workdir = Path(tempfile.mkdtemp(prefix="esk-cluster-kill-"))
            return await run(kafka, workdir, schedule, workload, console)

    verdict = run_harness(harness())
    exit_with(verdict, f"{verdict.broker_kills} broker kills in {args.minutes:g} min, {args.rate:.0f} commands/s wanted", console, 30)


if __name__ == "__main__":
    main()
