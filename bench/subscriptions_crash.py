"""The subscriptions' crash harness: SIGKILL the example subscribers (`customer_ledger`, a
database handler on SQLite, and `payments`, a reactor) again and again while orders come in
over HTTP, then check from the topics themselves that every event was applied once.

    python -m bench.subscriptions_crash --kills 30          (make subscriptions-crash)

The load places orders at a steady rate (Prefer: respond-async; every 202 is an
acknowledged command), most of them paid from an account (a funded one, an empty one, a
closed one, or one that does not exist), and adds lines to orders placed before. Each kill
takes one of the two subscribers (or both) at a random instant and starts it again. In the
end, once both have caught up, it checks:
- the ledger equals a reference computed from the orders' events topic (orders and total
  per customer);
- every order placed with `pay_from` has exactly one outcome: one withdrawal of its total,
  or its cancellation, never both, never two;
- the commands topic holds each command of the saga once (read_committed): no kill made the
  reactor send one twice;
- every account's balance is its deposits less the withdrawals of the orders it paid;
- nothing is parked.

It runs on a broker of its own (stopped on Ctrl-C or SIGTERM too), unless
ESK_KAFKA__BOOTSTRAP_SERVERS names a cluster.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import sqlite3
import time
import uuid
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
from rich.console import Console
from rich.table import Table

from bench.cluster import Cluster, api_ready, exit_with, harness_application, run_harness, wait_until
from esk.kafka.reader import read_committed
from esk.kafka.topics import TopicNames, ensure_topics, topic_specs
from esk.registry import load_registry
from esk.settings import Settings
from esk.subscriptions.api import event_key
from esk.subscriptions.catalog import load_subscriptions
from esk.subscriptions.operations import SubscriptionOperations
from esk.subscriptions.routing import derived_command_id

DEPOSIT = 10_000_000  # each funded account's starting balance: enough for every order; the empty one refuses them


@dataclass
class Verdict:
    """What the topics and the ledger say after a run; `ok` only when every count that must be zero is."""

    acknowledged: int = 0
    orders: int = 0
    orders_with_pay_from: int = 0
    paid: int = 0
    cancelled: int = 0
    ledger_mismatches: int = 0
    orders_without_outcome: int = 0
    orders_paid_twice_or_paid_and_cancelled: int = 0
    saga_commands_sent_twice: int = 0
    balance_mismatches: int = 0
    parked: int = 0
    subscriber_starts: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (
            self.ledger_mismatches
            or self.orders_without_outcome
            or self.orders_paid_twice_or_paid_and_cancelled
            or self.saga_commands_sent_twice
            or self.balance_mismatches
            or self.parked
        )

    def table(self, title: str) -> Table:
        table = Table(title=title)
        table.add_column("check")
        table.add_column("count", justify="right")
        for name, value in vars(self).items():
            if name != "notes":
                table.add_row(name.replace("_", " "), f"{value:,}")
        table.add_row("verdict", "[green]OK[/green]" if self.ok else "[red]FAILED[/red]")
        return table


class OrderLoad:
    """Orders at a steady rate over HTTP; remembers every acknowledged command id."""

    def __init__(self, api_url: str, accounts: list[str], rate: float, seed: int) -> None:
        self.api_url = api_url
        self.accounts = accounts  # what orders are paid from: funded, empty, closed or unknown
        self.rate = rate
        self.rng = random.Random(seed)
        self.acknowledged: set[str] = set()
        self.refused: Counter[str] = Counter()
        self.placed: list[str] = []
        self._stop = asyncio.Event()

    async def run(self) -> None:
        async with httpx.AsyncClient(base_url=self.api_url, timeout=30) as client:
            inflight: set[asyncio.Task[None]] = set()
            next_at = time.monotonic()
            while not self._stop.is_set():
                task = asyncio.create_task(self._one(client))
                inflight.add(task)
                task.add_done_callback(inflight.discard)
                next_at += 1 / self.rate
                await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            await asyncio.gather(*inflight)

    async def _one(self, client: httpx.AsyncClient) -> None:
        command_id = uuid.uuid4().hex
        rng = self.rng
        body: dict[str, Any]
        if self.placed and rng.random() < 0.25:
            order = rng.choice(self.placed)
            path, body = f"/v1/orders/{order}/add-line", {"sku": "extra", "qty": rng.randint(1, 3), "price": rng.randint(1, 50)}
        else:
            order = f"o-{uuid.uuid4().hex[:10]}"
            lines = [{"sku": f"s{n}", "qty": rng.randint(1, 3), "price": rng.randint(1, 100)} for n in range(rng.randint(1, 3))]
            path, body = f"/v1/orders/{order}/place", {"customer_id": f"c{rng.randint(1, 20)}", "lines": lines}
            pay_from = rng.choice([*self.accounts, None])
            if pay_from is not None:
                body["pay_from"] = pay_from
            self.placed.append(order)
        try:
            r = await client.post(path, json=body, headers={"Idempotency-Key": command_id, "Prefer": "respond-async"})
        except httpx.TransportError as error:  # not acknowledged: it may or may not be stored, as a client sees it
            self.refused[type(error).__name__] += 1
            return
        if r.status_code == 202:
            self.acknowledged.add(command_id)
        else:
            self.refused[str(r.status_code)] += 1

    def stop(self) -> None:
        self._stop.set()


async def prepare_accounts(client: httpx.AsyncClient, funded: list[str], empty: list[str], closed: list[str]) -> None:
    for account in (*funded, *empty, *closed):
        r = await client.post(f"/v1/accounts/{account}/open", json={"owner": account})
        r.raise_for_status()
    for account in funded:
        (await client.post(f"/v1/accounts/{account}/deposit", json={"amount": DEPOSIT})).raise_for_status()
    for account in closed:
        (await client.post(f"/v1/accounts/{account}/close", json={})).raise_for_status()


async def wait_for_outcomes(settings: Settings, acknowledged: set[str], timeout_s: float = 120) -> None:
    """Until every acknowledged command has its outcome (so every event is written)."""
    deadline = time.monotonic() + timeout_s
    while True:
        results = await read_committed(settings, TopicNames(settings.app).results)
        seen = {orjson.loads(r.value)["command_id"] for r in results if r.value is not None}
        if acknowledged <= seen or time.monotonic() > deadline:
            return
        await asyncio.sleep(1)


async def wait_until_settled(settings: Settings, operations: list[SubscriptionOperations], timeout_s: float = 120) -> None:
    """Nothing left in flight: every command on the commands topic (the saga's too) has its
    outcome and both subscriptions have caught up, twice in a row a second apart (a command
    the saga sends after it caught up once makes events and outcomes it reads again)."""
    deadline = time.monotonic() + timeout_s
    streak = 0
    while streak < 2:
        statuses = [await o.status() for o in operations]
        unanswered = await commands_without_outcome(settings)
        streak = streak + 1 if not unanswered and all(s.caught_up for s in statuses) else 0
        if time.monotonic() > deadline:
            raise TimeoutError(f"not settled: {unanswered} commands without outcome, subscriptions {[(s.name, s.lag) for s in statuses]}")
        await asyncio.sleep(1)


async def commands_without_outcome(settings: Settings) -> int:
    """Commands on the commands topic with no outcome yet. (Offsets cannot tell: the saga
    writes commands in transactions, whose markers take offsets no consumer commits past.)"""
    names = TopicNames(settings.app)
    commands = {orjson.loads(r.value)["command_id"] for r in await read_committed(settings, names.commands) if r.value}
    answered = {orjson.loads(r.value)["command_id"] for r in await read_committed(settings, names.results) if r.value}
    return len(commands - answered)


async def verify(settings: Settings, api_url: str, ledger_path: Path, funded: list[str], operations: list[SubscriptionOperations]) -> Verdict:
    names = TopicNames(settings.app)
    verdict = Verdict()
    order_records = await read_committed(settings, names.events("orders"))
    orders_events = [orjson.loads(r.value) for r in order_records]
    accounts_events = [orjson.loads(r.value) for r in await read_committed(settings, names.events("accounts"))]
    commands = [orjson.loads(r.value) for r in await read_committed(settings, names.commands)]

    # the ledger, against the orders' events
    reference: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    customer_of: dict[str, str] = {}
    for event in orders_events:
        data = event["data"]
        if event["type"] == "Placed":
            customer_of[event["aggregate_id"]] = data["customer_id"]
            reference[data["customer_id"]][0] += 1
            reference[data["customer_id"]][1] += sum(line["qty"] * line["price"] for line in data["lines"])
        elif event["type"] == "LineAdded":
            reference[customer_of[event["aggregate_id"]]][1] += data["qty"] * data["price"]
    with contextlib.closing(sqlite3.connect(ledger_path)) as db:
        ledger = {customer: [orders, total] for customer, orders, total in db.execute("SELECT customer_id, orders, total FROM customer_ledger")}
    for customer in set(reference) | set(ledger):
        if reference.get(customer) != ledger.get(customer):
            verdict.ledger_mismatches += 1
            verdict.notes.append(f"ledger of {customer}: {ledger.get(customer)}, events say {reference.get(customer)}")

    # the saga: one outcome per order paid from an account
    withdrawals = Counter(e["command_id"] for e in accounts_events if e["type"] == "Withdrawn")
    cancels = Counter(e["command_id"] for e in orders_events if e["type"] == "Cancelled")
    spent: Counter[str] = Counter()
    for record, event in zip(order_records, orders_events, strict=True):
        if event["type"] != "Placed":
            continue
        verdict.orders += 1
        data = event["data"]
        total = sum(line["qty"] * line["price"] for line in data["lines"])
        if data.get("pay_from") is None:
            continue
        verdict.orders_with_pay_from += 1
        withdraw_id = derived_command_id("payments", event_key(event["event_id"], record.partition, record.offset), 0)
        paid, cancelled = withdrawals[withdraw_id], cancels[derived_command_id("payments", withdraw_id, 0)]
        verdict.paid += paid
        verdict.cancelled += cancelled
        spent[data["pay_from"]] += total * paid
        if paid + cancelled == 0:
            verdict.orders_without_outcome += 1
            verdict.notes.append(f"order {event['aggregate_id']}: neither paid nor cancelled")
        elif paid + cancelled > 1:
            verdict.orders_paid_twice_or_paid_and_cancelled += 1
            verdict.notes.append(f"order {event['aggregate_id']}: paid {paid}, cancelled {cancelled}")
    sent = Counter(c["command_id"] for c in commands if c["command_id"].startswith("payments:"))
    verdict.saga_commands_sent_twice = sum(1 for n in sent.values() if n > 1)

    async with httpx.AsyncClient(base_url=api_url, timeout=30) as client:
        for account in funded:
            state = (await client.get(f"/v1/accounts/{account}")).json()["state"]
            if state["balance"] != DEPOSIT - spent[account]:
                verdict.balance_mismatches += 1
                verdict.notes.append(f"{account}: balance {state['balance']}, expected {DEPOSIT - spent[account]}")
    verdict.parked = sum([len(await o.parked()) for o in operations])
    return verdict


async def run(
    settings: Settings, workdir: Path, kills: int, rate: float, min_gap_s: float, max_gap_s: float, seed: int, console: Console
) -> Verdict:
    registry = load_registry(settings.domain)
    report = await ensure_topics(settings, topic_specs(settings, registry))
    if report.problems:
        raise RuntimeError(report.problems)
    subscriptions = load_subscriptions(settings.subscriptions)
    cluster = Cluster(settings, workdir)
    data_dir = workdir / "subscriptions"
    # what the checks read: the subscribers' databases, not the current directory's
    settings = settings.model_copy(update={"subscriber": settings.subscriber.model_copy(update={"data_dir": data_dir})})
    fast = {"ESK_SUBSCRIBER__SESSION_TIMEOUT_MS": "6000"}
    api, processor = cluster.api("api"), cluster.processor("processor")
    subscribers = [cluster.subscriber(name, name, data_dir, **fast) for name in ("customer_ledger", "payments")]
    rng = random.Random(seed)
    funded, empty, closed = [f"funded-{n}" for n in range(5)], ["empty-0"], ["closed-0"]
    try:
        api.start()
        processor.start()
        api_url = f"http://127.0.0.1:{api.port}"
        await asyncio.to_thread(wait_until, lambda: api_ready(api_url), 60, "API ready")
        async with httpx.AsyncClient(base_url=api_url, timeout=30) as client:
            await prepare_accounts(client, funded, empty, closed)
        for subscriber in subscribers:
            subscriber.start()
        load = OrderLoad(api_url, [*funded, *funded, *empty, *closed, "unknown-0"], rate, seed)
        driving = asyncio.create_task(load.run())
        for kill in range(1, kills + 1):
            await asyncio.sleep(rng.uniform(min_gap_s, max_gap_s))
            victims = rng.choice([[subscribers[0]], [subscribers[1]], subscribers])
            for victim in victims:
                victim.kill()
                victim.start()
            console.print(
                f"kill {kill}/{kills}: {', '.join(v.name for v in victims)} SIGKILLed and restarted; "
                f"{len(load.acknowledged):,} commands acknowledged so far",
                highlight=False,
            )
        load.stop()
        await driving
        if load.refused:
            console.print(f"refused by the API (never acknowledged): {dict(load.refused)}")
        await wait_for_outcomes(settings, load.acknowledged)
        operations = [SubscriptionOperations(settings, subscriptions[s.name], registry) for s in subscribers]
        await wait_until_settled(settings, operations)
        verdict = await verify(settings, api_url, data_dir / "customer_ledger.sqlite", funded, operations)
        verdict.acknowledged = len(load.acknowledged)
        verdict.subscriber_starts = sum(s.starts for s in subscribers)
        return verdict
    finally:
        cluster.stop_all()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=30)
    parser.add_argument("--rate", type=float, default=100, help="commands per second")
    # A restarted member joins once the killed one's session has expired (6 s): gaps shorter
    # than that kill subscribers that never got their partitions back.
    parser.add_argument("--min-gap", type=float, default=1.0, help="seconds between kills, at least")
    parser.add_argument("--max-gap", type=float, default=10.0, help="seconds between kills, at most")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    console = Console()

    async def harness() -> Verdict:
        async with harness_application("subcrash", console) as (settings, workdir):
            return await run(settings, workdir, args.kills, args.rate, args.min_gap, args.max_gap, args.seed, console)

    verdict = run_harness(harness())
    exit_with(verdict, f"subscriptions crash harness: {args.kills} SIGKILLs at {args.rate:.0f} commands/s", console)


if __name__ == "__main__":
    main()
