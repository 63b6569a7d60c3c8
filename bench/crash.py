"""The crash harness: SIGKILL the processor again and again under load, then check, from
the topics themselves, that nothing was lost, duplicated or left with a gap.

    python -m bench.crash --kills 50          (make crash)

It drives commands over HTTP at a steady rate across many accounts (Prefer:
respond-async, so every 202 is an acknowledged command), kills the processor at random
instants (mid-batch, mid-commit, mid-restore: every few kills the state directory is
wiped too, forcing a full restore that the next kill may interrupt), restarts it, and
finally checks:
- every acknowledged command has exactly one outcome on the results topic;
- events per account are versions 1..n with no gap or duplicate, and exactly the events
  of the accepted outcomes;
- the state the API serves equals the fold of the events;
- the DLQ is empty.

It runs on a broker of its own (stopped on Ctrl-C or SIGTERM too), unless
ESK_KAFKA__BOOTSTRAP_SERVERS names a cluster.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shutil
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
from rich.console import Console
from rich.table import Table

from bench.cluster import Cluster, EskProcess, api_ready, exit_with, harness_application, run_harness, wait_until
from domain.accounts import accounts as accounts_type
from esk.kafka.reader import read_committed
from esk.kafka.topics import TopicNames, ensure_topics, topic_specs
from esk.registry import load_registry
from esk.settings import Settings


@dataclass
class Verdict:
    """What the topics say after a run; `ok` only when every count that must be zero is."""

    acknowledged: int = 0
    outcomes: int = 0
    missing_outcomes: int = 0
    duplicate_outcomes: int = 0
    # A command that reached the commands topic again (a client's retry with the same
    # Idempotency-Key) is answered again with its first outcome, byte for byte: expected.
    repeated_outcomes: int = 0
    accepted: int = 0
    events: int = 0
    aggregates: int = 0
    version_gaps_or_duplicates: int = 0
    events_not_matching_outcomes: int = 0
    state_mismatches: int = 0
    dlq: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (
            self.missing_outcomes
            or self.duplicate_outcomes
            or self.version_gaps_or_duplicates
            or self.events_not_matching_outcomes
            or self.state_mismatches
            or self.dlq
        )

    def table(self, title: str) -> Table:
        return verdict_table(title, count_rows(self), self.ok)


def count_rows(verdict: object, prefix: str = "") -> list[tuple[str, str]]:
    """A verdict's counts (its int fields), named as the verdict tables show them."""
    return [(prefix + name.replace("_", " "), f"{value:,}") for name, value in vars(verdict).items() if isinstance(value, int)]


def verdict_table(title: str, rows: list[tuple[str, str]], ok: bool) -> Table:
    table = Table(title=title)
    table.add_column("check")
    table.add_column("count", justify="right")
    for name, value in rows:
        table.add_row(name, value)
    table.add_row("verdict", "[green]OK[/green]" if ok else "[red]FAILED[/red]")
    return table


async def verify(
    settings: Settings, api_url: str, acknowledged: set[str], timeout_s: float = 120, retried: AbstractSet[str] = frozenset()
) -> Verdict:
    """Check the topics (read_committed) against the acknowledged command ids. A command
    in `retried` was sent more than once: its first outcome may be published again, but
    never a different one."""
    names = TopicNames(settings.app)
    verdict = Verdict(acknowledged=len(acknowledged))
    deadline = time.monotonic() + timeout_s
    while True:
        results = await read_committed(settings, names.results)
        encoded: list[bytes] = [r.value for r in results if r.value is not None]
        decoded = [orjson.loads(value) for value in encoded]
        per_command = Counter(outcome["command_id"] for outcome in decoded)
        missing = acknowledged - set(per_command)
        if not missing or time.monotonic() > deadline:
            break
        await asyncio.sleep(1)
    verdict.outcomes = len(results)
    verdict.missing_outcomes = len(missing)
    distinct: defaultdict[str, set[bytes]] = defaultdict(set)
    for value, outcome in zip(encoded, decoded, strict=True):
        distinct[outcome["command_id"]].add(value)
    for cid in acknowledged:
        if len(distinct[cid]) > 1 or (per_command[cid] > 1 and cid not in retried):
            verdict.duplicate_outcomes += 1
        elif per_command[cid] > 1:
            verdict.repeated_outcomes += per_command[cid] - 1
    outcomes = {outcome["command_id"]: outcome for outcome in decoded}
    accepted_events: defaultdict[str, int] = defaultdict(int)
    for outcome in outcomes.values():
        if outcome["status"] == "accepted":
            verdict.accepted += 1
            accepted_events[outcome["aggregate_id"]] += len(outcome["events"])

    history: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for record in await read_committed(settings, names.events("accounts")):
        event = orjson.loads(record.value)
        history[event["aggregate_id"]].append(event)
    verdict.events = sum(len(h) for h in history.values())
    verdict.aggregates = len(history)
    async with httpx.AsyncClient(base_url=api_url, timeout=30) as client:
        for account, events in history.items():
            versions = [e["version"] for e in events]
            if versions != list(range(1, len(versions) + 1)):
                verdict.version_gaps_or_duplicates += 1
                verdict.notes.append(f"{account}: versions {versions}")
            if accepted_events[account] != len(events):
                verdict.events_not_matching_outcomes += 1
            folded = accounts_type.fold(
                accounts_type.decode_event(e["type"], e["schema_version"], e["data"]) for e in events
            )
            served = await client.get(f"/v1/accounts/{account}", params={"min_version": len(events)})
            if folded is None or served.status_code != 200 or served.json()["state"] != folded.model_dump():
                verdict.state_mismatches += 1
                verdict.notes.append(f"{account}: served {served.text[:200]} != folded {folded}")
    verdict.dlq = len(await read_committed(settings, names.dlq))
    return verdict


class Load:
    """Commands at a steady rate over HTTP; remembers every acknowledged command id."""

    def __init__(self, api_url: str, accounts: list[str], rate: float, seed: int) -> None:
        self.api_url = api_url
        self.accounts = accounts
        self.rate = rate
        self.rng = random.Random(seed)
        self.acknowledged: set[str] = set()
        self.refused: Counter[int] = Counter()
        self._stop = asyncio.Event()

    async def open_accounts(self, client: httpx.AsyncClient) -> None:
        for account in self.accounts:
            command_id = f"open-{account}"
            r = await client.post(
                f"/v1/accounts/{account}/open",
                json={"owner": account},
                headers={"Idempotency-Key": command_id, "Prefer": "respond-async"},
            )
            r.raise_for_status()
            self.acknowledged.add(command_id)

    async def run(self) -> None:
        async with httpx.AsyncClient(base_url=self.api_url, timeout=30) as client:
            await self.open_accounts(client)
            inflight: set[asyncio.Task[None]] = set()
            interval = 1 / self.rate
            next_at = time.monotonic()
            while not self._stop.is_set():
                task = asyncio.create_task(self._one(client))
                inflight.add(task)
                task.add_done_callback(inflight.discard)
                next_at += interval
                await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            await asyncio.gather(*inflight)

    async def _one(self, client: httpx.AsyncClient) -> None:
        account = self.rng.choice(self.accounts)
        command = self.rng.choice(["deposit", "deposit", "deposit", "withdraw", "withdraw"])
        command_id = uuid.uuid4().hex
        r = await client.post(
            f"/v1/accounts/{account}/{command}",
            json={"amount": self.rng.randint(1, 100)},
            headers={"Idempotency-Key": command_id, "Prefer": "respond-async"},
        )
        if r.status_code == 202:
            self.acknowledged.add(command_id)
        else:
            self.refused[r.status_code] += 1

    def stop(self) -> None:
        self._stop.set()


async def run(
    settings: Settings,
    workdir: Path,
    kills: int,
    rate: float,
    accounts: int,
    min_gap_s: float,
    max_gap_s: float,
    wipe_every: int,
    seed: int,
    console: Console,
) -> Verdict:
    registry = load_registry(settings.domain)
    report = await ensure_topics(settings, topic_specs(settings, registry))
    if report.problems:
        raise RuntimeError(report.problems)
    cluster = Cluster(settings, workdir)
    api = cluster.api("api")
    processor = cluster.processor("processor", ESK_PROCESSOR__SESSION_TIMEOUT_MS="6000")
    rng = random.Random(seed)
    try:
        api.start()
        processor.start()
        api_url = f"http://127.0.0.1:{api.port}"
        await asyncio.to_thread(wait_until, lambda: api_ready(api_url), 60, "API ready")
        load = Load(api_url, [f"acc-{n}" for n in range(accounts)], rate, seed)
        driving = asyncio.create_task(load.run())
        for kill in range(1, kills + 1):
            await asyncio.sleep(rng.uniform(min_gap_s, max_gap_s))
            processor.kill()
            wiped = wipe_every > 0 and kill % wipe_every == 0
            if wiped:
                shutil.rmtree(processor.env["ESK_PROCESSOR__STATE_DIR"], ignore_errors=True)
            processor.start()
            console.print(
                f"kill {kill}/{kills}: processor SIGKILLed{' and its state wiped' if wiped else ''}, restarted; "
                f"{len(load.acknowledged):,} commands acknowledged so far",
                highlight=False,
            )
        load.stop()
        await driving
        if load.refused:
            console.print(f"refused by the API (never acknowledged): {dict(load.refused)}")
        verdict = await verify(settings, api_url, load.acknowledged)
        restarts = _restores(processor)
        verdict.notes.append(f"processor starts: {processor.starts}; {restarts}")
        return verdict
    finally:
        cluster.stop_all()


def _restores(processor: EskProcess) -> str:
    text = processor.log_text()
    return f"restore log lines: {text.count('restored ')}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=50)
    parser.add_argument("--rate", type=float, default=200, help="commands per second")
    parser.add_argument("--accounts", type=int, default=200)
    parser.add_argument("--min-gap", type=float, default=0.3, help="seconds between kills, at least")
    parser.add_argument("--max-gap", type=float, default=3.0, help="seconds between kills, at most")
    parser.add_argument("--wipe-every", type=int, default=10, help="wipe the state dir every N kills (0: never)")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    console = Console()

    async def harness() -> Verdict:
        async with harness_application("crash", console) as (settings, workdir):
            return await run(
                settings, workdir, args.kills, args.rate, args.accounts, args.min_gap, args.max_gap, args.wipe_every,
                args.seed, console,
            )

    exit_with(run_harness(harness()), f"crash harness: {args.kills} SIGKILLs at {args.rate:.0f} commands/s", console)


if __name__ == "__main__":
    main()
