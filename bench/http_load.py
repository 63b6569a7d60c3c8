"""The HTTP load generator of W2 and W4: commands over `POST /v1/{type}/{id}/{command}`,
in a process of its own so that its CPU shows up as a process beside the API's.

    python -m bench.http_load SPEC_JSON RESULT_PATH      (run_load() starts it)

One run is one phase, reading one request source:
- closed loop (`concurrency`): that many requests in flight, each sent when the previous
  one answered: the rate the system sustains at saturation;
- open loop (`rate`): request i is due at start + i / rate, whatever happened before, and
  its latency counts from that instant, so a slow answer that delays the generator still
  shows in the latencies (no coordinated omission).

Every request waits for the command's outcome (no `Prefer: respond-async`): a latency is a
command handled end to end. The client is aiohttp on uvloop, chosen on measurement: at
256 requests in flight against this machine's API, httpx got about 50 commands/s through
using 0.7 of a core, aiohttp about 500/s using 0.15 (its CPU is taken from the same two
cores as the API's and the processor's).
"""

from __future__ import annotations

import asyncio
import itertools
import random
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import orjson

from app.protocol import CommandEnvelope
from bench.measure import percentile
from bench.workload import account_ids, account_moves, account_opens, order_place

# Answers that carry the command's outcome: accepted, or refused by the domain or a precondition.
OUTCOMES = frozenset({200, 404, 409, 412, 422})
NO_ANSWER = 0  # the status recorded for a request that got no HTTP answer


@dataclass
class LoadSpec:
    """One phase of load: a request source, driven closed loop or open loop."""

    url: str
    name: str
    source: str  # "opens", "moves" (accounts) or "places" (orders)
    concurrency: int = 0  # closed loop when > 0: requests in flight
    rate: float = 0.0  # open loop when > 0: requests per second
    duration_s: float | None = None  # None: until the source runs out
    accounts: int = 0
    customers: int = 1
    seed: int = 1
    id_prefix: str = "load-"  # of the order ids that "places" makes up


@dataclass
class LoadResult:
    name: str
    elapsed_s: float  # from the phase's start to its last answer
    latencies_s: list[float] = field(default_factory=list)
    statuses: list[int] = field(default_factory=list)
    ids: list[str] = field(default_factory=list)  # aggregate ids, in answer order
    answered_at: list[float] = field(default_factory=list)  # wall clock (epoch seconds)
    cpu_s: float = 0.0  # the generator's own CPU time during the phase
    failures: dict[str, int] = field(default_factory=dict)  # requests with no HTTP answer, by exception

    @property
    def answered(self) -> int:
        return sum(1 for s in self.statuses if s in OUTCOMES)

    @property
    def errors(self) -> int:
        return len(self.statuses) - self.answered

    @property
    def rate(self) -> float:
        return self.answered / self.elapsed_s if self.elapsed_s else 0.0

    def latency_ms(self, q: float) -> float:
        return percentile([s for s, status in zip(self.latencies_s, self.statuses) if status in OUTCOMES], q) * 1000

    def describe_errors(self) -> str:
        counts = {f"HTTP {s}": self.statuses.count(s) for s in sorted(set(self.statuses) - OUTCOMES - {NO_ANSWER})}
        counts |= self.failures
        return ", ".join(f"{n:,} x {kind}" for kind, n in counts.items()) or "no errors"


async def run_load(spec: LoadSpec, workdir: Path) -> LoadResult:
    """Run the generator as a child process and return what it measured."""
    stem = spec.name.replace(" ", "-")
    result_path, log_path = workdir / f"{stem}.json", workdir / f"{stem}.log"
    with open(log_path, "wb") as log:
        child = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "bench.http_load", orjson.dumps(spec).decode(), str(result_path),
            stdout=log, stderr=asyncio.subprocess.STDOUT,
        )
        if await child.wait() != 0:
            raise RuntimeError(f"the load generator failed; see {log_path}")
    return LoadResult(**orjson.loads(result_path.read_bytes()))


# -- the generator process ---------------------------------------------------------------

Request = tuple[str, bytes, dict[str, str], str]  # path, body, headers, aggregate id


def as_request(command: CommandEnvelope) -> Request:
    headers = {"Content-Type": "application/json", "Idempotency-Key": command.command_id}
    if command.expect_new:
        headers["If-None-Match"] = "*"
    if command.expected_version is not None:
        headers["If-Match"] = f'"{command.expected_version}"'
    path = f"/v1/{command.aggregate_type}/{command.aggregate_id}/{command.command}"
    return path, orjson.dumps(command.payload), headers, command.aggregate_id


def request_stream(spec: LoadSpec) -> Iterator[Request]:
    ids = account_ids(spec.accounts)
    rng = random.Random(spec.seed)
    # unique to this run, so that no Idempotency-Key of an earlier phase is answered from memory
    run_id = f"{time.time_ns():x}"
    if spec.source == "opens":
        return map(as_request, account_opens(ids))
    if spec.source == "moves":
        return map(as_request, account_moves(ids, spec.seed, id_prefix=run_id))
    if spec.source == "places":
        customers = (f"cust-{rng.randrange(spec.customers)}" for _ in itertools.count())
        return map(as_request, (order_place(f"{spec.id_prefix}{run_id}-{n}", c, rng) for n, c in enumerate(customers)))
    raise ValueError(f"unknown request source {spec.source!r}")


async def _post(session: aiohttp.ClientSession, request: Request) -> int | str:
    """The HTTP status, or what stood in for an answer: the exception's type and, for an OS
    error, its reason (never the message: it names the URL, and kinds are counted)."""
    path, body, headers, _ = request
    try:
        async with session.post(path, data=body, headers=headers) as response:
            await response.read()
            return response.status
    except (aiohttp.ClientError, asyncio.TimeoutError) as error:
        reason = error.strerror if isinstance(error, OSError) else None
        return f"{type(error).__name__} ({reason})" if reason else type(error).__name__


async def _closed(requests: Iterator[Request], concurrency: int, until: float, send: Callable[[Request, float], Awaitable[None]]) -> None:
    async def worker() -> None:
        for request in requests:  # shared by the workers: each takes the next one
            now = time.monotonic()
            if now >= until:
                return
            await send(request, now)

    await asyncio.gather(*(worker() for _ in range(concurrency)))


async def _open(requests: Iterator[Request], rate: float, started: float, until: float,
                send: Callable[[Request, float], Awaitable[None]]) -> None:
    in_flight: set[asyncio.Task[None]] = set()
    for n, request in enumerate(requests):
        due = started + n / rate
        if due >= until:
            break
        # Sleep only when ahead: requests that fell due meanwhile go out at once, late, and
        # their lateness is part of their latency.
        if due > time.monotonic():
            await asyncio.sleep(due - time.monotonic())
        task = asyncio.create_task(send(request, due))
        in_flight.add(task)
        task.add_done_callback(in_flight.discard)
    await asyncio.gather(*in_flight)


async def _drive(session: aiohttp.ClientSession, phase: LoadSpec, requests: Iterator[Request]) -> LoadResult:
    result = LoadResult(phase.name, 0.0)
    cpu_before = time.process_time()
    started = time.monotonic()
    wall_offset = time.time() - started
    until = started + phase.duration_s if phase.duration_s is not None else float("inf")

    async def send(request: Request, scheduled: float) -> None:
        answer = await _post(session, request)
        done = time.monotonic()
        if isinstance(answer, str):
            result.failures[answer] = result.failures.get(answer, 0) + 1
        result.statuses.append(answer if isinstance(answer, int) else NO_ANSWER)
        result.latencies_s.append(done - scheduled)
        result.ids.append(request[3])
        result.answered_at.append(wall_offset + done)
        result.elapsed_s = done - started

    if phase.concurrency > 0:
        await _closed(requests, phase.concurrency, until, send)
    else:
        await _open(requests, phase.rate, started, until, send)
    result.cpu_s = time.process_time() - cpu_before
    return result


async def _generate(spec: LoadSpec) -> LoadResult:
    connector = aiohttp.TCPConnector(limit=0)  # the open loop must never wait for a connection
    # Bounds how long a phase outlives its duration when the system falls behind; the API
    # answers 503 itself after ESK_API__OUTCOME_TIMEOUT_S (10 s) once it has the request.
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(spec.url, connector=connector, timeout=timeout) as session:
        return await _drive(session, spec, request_stream(spec))


def main() -> None:
    import uvloop

    spec, result_path = LoadSpec(**orjson.loads(sys.argv[1])), Path(sys.argv[2])
    result = uvloop.run(_generate(spec))
    result_path.write_bytes(orjson.dumps(result))
    print(f"{result.name}: {len(result.statuses):,} requests in {result.elapsed_s:.1f}s; {result.describe_errors()}")


if __name__ == "__main__":
    main()
