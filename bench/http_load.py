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
command handled end to end. The generator's CPU is taken from the same two cores as the
API's and the processor's, so it has to be cheap: the client is a minimal HTTP/1.1 one
(`HttpClient`: keep-alive connections on asyncio protocols, on uvloop, one request in
flight per connection), chosen on measurement. At 256 requests in flight against this
machine's API, httpx got about 50 commands/s through using 0.7 of a core, aiohttp about
500/s using 0.15; at 1,000 commands/s, aiohttp took 0.31-0.41 of a core, HttpClient 0.13-0.14.
It speaks just what the esk API answers: a status line, headers, a Content-Length body.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from bench.measure import percentile
from bench.workload import account_ids, account_moves, account_opens, order_place
from esk.protocol import CommandEnvelope

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
    pay_from_share: float = 0.0  # of the orders "places" makes up, those paid from an account


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
        return percentile([s for s, status in zip(self.latencies_s, self.statuses, strict=True) if status in OUTCOMES], q) * 1000

    def describe_errors(self) -> str:
        counts = {f"HTTP {s}": self.statuses.count(s) for s in sorted(set(self.statuses) - OUTCOMES - {NO_ANSWER})}
        counts |= self.failures
        return ", ".join(f"{n:,} x {kind}" for kind, n in counts.items()) or "no errors"


async def run_load(spec: LoadSpec, workdir: Path) -> LoadResult:
    """Run the generator as a child process and return what it measured."""
    stem = spec.name.replace(" ", "-")
    result_path, log_path = workdir / f"{stem}.json", workdir / f"{stem}.log"
    with open(log_path, "wb") as log:  # noqa: ASYNC230 - opened once, before the child starts
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
        return map(as_request, (order_place(f"{spec.id_prefix}{run_id}-{n}", c, rng, spec.pay_from_share) for n, c in enumerate(customers)))
    raise ValueError(f"unknown request source {spec.source!r}")


class _Connection(asyncio.Protocol):
    """One keep-alive connection; one request at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.open = True
        self._buffer = bytearray()
        self._answer: asyncio.Future[int] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # asyncio hands the base type; create_connection made a socket transport

    def connection_lost(self, error: Exception | None) -> None:
        self.open = False
        if self._answer is not None and not self._answer.done():
            self._answer.set_exception(error or ConnectionResetError("the server closed the connection"))

    def request(self, message: bytes) -> asyncio.Future[int]:
        assert self.transport is not None and self._answer is None
        self._answer = asyncio.get_running_loop().create_future()
        self.transport.write(message)
        return self._answer

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        head_end = self._buffer.find(b"\r\n\r\n")
        if head_end < 0 or self._answer is None:
            return
        head = bytes(self._buffer[:head_end]).split(b"\r\n")
        fields = {name.strip().lower(): value.strip() for name, _, value in (line.partition(b":") for line in head[1:])}
        if b"content-length" not in fields:
            self.close(ValueError("an answer without Content-Length"))
            return
        end = head_end + 4 + int(fields[b"content-length"])
        if len(self._buffer) < end:
            return
        del self._buffer[:end]
        answer, self._answer = self._answer, None
        answer.set_result(int(head[0].split()[1]))
        if fields.get(b"connection", b"").lower() == b"close":
            self.close(ConnectionResetError("the server closed the connection"))

    def close(self, error: Exception) -> None:
        self.open = False
        if self._answer is not None and not self._answer.done():
            self._answer.set_exception(error)
        if self.transport is not None:
            self.transport.close()


class HttpClient:
    """POSTs over a pool of keep-alive connections, as many as there are requests in flight.

    A connection idle for `idle_max_s` is closed rather than used: a server closes idle
    connections after its keep-alive timeout, and a request sent on one as it does so is
    reset (W4's load met it against uvicorn's default of 5 s)."""

    def __init__(self, url: str, timeout_s: float, idle_max_s: float = 4.0) -> None:
        address = url.split("://", 1)[-1].rstrip("/")
        self.host, _, port = address.partition(":")
        self.port = int(port or 80)
        self.timeout_s = timeout_s
        self.idle_max_s = idle_max_s
        self._idle: list[tuple[_Connection, float]] = []  # and when it went idle

    async def post(self, path: str, body: bytes, headers: dict[str, str]) -> int:
        lines = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
        message = (f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\n{lines}Content-Length: {len(body)}\r\n\r\n").encode() + body
        connection = await self._connection()
        try:
            async with asyncio.timeout(self.timeout_s):
                status = await connection.request(message)
        except BaseException as error:
            connection.close(ConnectionAbortedError(f"request abandoned: {error!r}"))
            raise
        self._idle.append((connection, time.monotonic()))
        return status

    async def _connection(self) -> _Connection:
        while self._idle:
            connection, since = self._idle.pop()
            if connection.open and time.monotonic() - since < self.idle_max_s:
                return connection
            connection.close(ConnectionAbortedError("idle for too long"))
        _, protocol = await asyncio.get_running_loop().create_connection(_Connection, self.host, self.port)
        return protocol

    def close(self) -> None:
        for connection, _ in self._idle:
            connection.close(ConnectionAbortedError("the client is closed"))


async def _post(client: HttpClient, request: Request) -> int | str:
    """The HTTP status, or what stood in for an answer: the exception's type and, for an OS
    error, its reason (never the message: it names the URL, and kinds are counted)."""
    path, body, headers, _ = request
    try:
        return await client.post(path, body, headers)
    except (OSError, TimeoutError, ValueError) as error:
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
                send: Callable[[Request, float], Coroutine[Any, Any, None]]) -> None:
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


async def _drive(client: HttpClient, phase: LoadSpec, requests: Iterator[Request]) -> LoadResult:
    result = LoadResult(phase.name, 0.0)
    cpu_before = time.process_time()
    started = time.monotonic()
    wall_offset = time.time() - started
    until = started + phase.duration_s if phase.duration_s is not None else float("inf")

    async def send(request: Request, scheduled: float) -> None:
        answer = await _post(client, request)
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
    # The timeout bounds how long a phase outlives its duration when the system falls
    # behind; the API answers 503 itself after ESK_API__OUTCOME_TIMEOUT_S (10 s) once it
    # has the request. No connection limit: the open loop must never wait for one.
    client = HttpClient(spec.url, timeout_s=30)
    try:
        return await _drive(client, spec, request_stream(spec))
    finally:
        client.close()


def main() -> None:
    import uvloop

    spec, result_path = LoadSpec(**orjson.loads(sys.argv[1])), Path(sys.argv[2])
    result = uvloop.run(_generate(spec))
    result_path.write_bytes(orjson.dumps(result))
    print(f"{result.name}: {len(result.statuses):,} requests in {result.elapsed_s:.1f}s; {result.describe_errors()}")


if __name__ == "__main__":
    main()
