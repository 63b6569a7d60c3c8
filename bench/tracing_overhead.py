"""W2 with OpenTelemetry tracing on against off, alternating, on one scratch broker:
`python -m bench.tracing_overhead [--pairs 2] [--rate 500] [--seconds 20]`.

One `esk api` and one `esk processor` (as W2), restarted for each run with tracing off or on
(the same state directories, so the accounts opened once are there for every run); each run
is an open loop of deposits and withdrawals at a fixed rate. With tracing on every span is
exported over OTLP/HTTP to a sink in this process that answers 200 and counts what it got:
the cost measured is esk's spans and headers plus the SDK's batching and export, without a
collector's. The pairs alternate which variant runs first, so drift in a shared machine's
load does not side with one. Reported: the API's and the processor's CPU per command and
the latency quantiles, and their ratios on/off.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from bench.cluster import Cluster, new_app, run_harness, scratch_broker, scratch_settings
from bench.http_load import LoadSpec, run_load
from bench.measure import cpu_cores
from bench.results import console
from esk.settings import Settings


class OtlpSink:
    """Accepts OTLP/HTTP exports (any POST) with an empty 200, as a collector that keeps
    nothing would; counts the requests and bytes, to show the spans did leave."""

    def __init__(self) -> None:
        self.requests = 0
        self.bytes = 0
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                sink.requests += 1
                sink.bytes += len(body)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: object) -> None:
                """Quiet: one line per export would drown the harness's output."""

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)

    @property
    def traces_url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/v1/traces"

    @contextmanager
    def serving(self) -> Iterator[OtlpSink]:
        thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        thread.start()
        try:
            yield self
        finally:
            self._server.shutdown()
            self._server.server_close()


def tracing_env(traces_url: str) -> dict[str, str]:
    """The settings of an esk process that traces everything and exports it to `traces_url`."""
    return {"ESK_TRACING__ENABLED": "true", "ESK_TRACING__EXPORTER": "otlp", "ESK_TRACING__ENDPOINT": traces_url}


@dataclass(frozen=True)
class Run:
    tracing: bool
    rate: float  # achieved, commands/s
    p50_ms: float
    p99_ms: float
    api_us: float  # CPU per command
    processor_us: float


async def run(pairs: int, rate: float, seconds: float, accounts: int, partitions: int) -> list[Run]:
    async with scratch_broker("esk-tracing") as broker:
        settings = await new_app(scratch_settings(broker, "tr", partitions), "w2")
        workdir = Path(tempfile.mkdtemp(prefix="esk-tracing-"))
        console.print(f"broker on {broker.bootstrap}; work in {workdir}")
        runs: list[Run] = []
        with OtlpSink().serving() as sink:
            for pair in range(pairs):
                for tracing in (False, True) if pair % 2 == 0 else (True, False):
                    env = tracing_env(sink.traces_url) if tracing else {}
                    runs.append(await _one_run(settings, workdir, env, rate, seconds, accounts, opening=not runs))
                    r = runs[-1]
                    console.print(
                        f"tracing {'on ' if tracing else 'off'}: {r.rate:,.0f}/s, p50 {r.p50_ms:.1f} ms, p99 {r.p99_ms:.1f} ms, "
                        f"CPU per command: API {r.api_us:.0f} us, processor {r.processor_us:.0f} us", highlight=False,
                    )
            console.print(f"the OTLP sink took {sink.requests:,} exports, {sink.bytes / 1e6:,.1f} MB")
        _summary(runs)
        return runs


async def _one_run(settings: Settings, workdir: Path, env: dict[str, str], rate: float, seconds: float, accounts: int, opening: bool) -> Run:
    cluster = Cluster(settings, workdir)
    api = cluster.api("api", **env)
    processor = cluster.processor("processor", **env)
    try:
        await asyncio.to_thread(cluster.start_all)
        load = LoadSpec(api.url, "open accounts", "opens", concurrency=64, accounts=accounts, seed=7)
        if opening:
            opened = await run_load(load, workdir)
            if opened.errors:
                raise RuntimeError(f"opening the accounts: {opened.describe_errors()}")
        load = LoadSpec(api.url, f"fixed rate {rate:.0f}", "moves", rate=rate, duration_s=seconds, accounts=accounts, seed=11)
        with cpu_cores({"api": api.pid, "processor": processor.pid}) as cores:
            fixed = await run_load(load, workdir)
        if fixed.errors:
            console.print(f"errors: {fixed.describe_errors()}")
        per_command = 1e6 / fixed.rate if fixed.rate else float("nan")
        return Run(bool(env), fixed.rate, fixed.latency_ms(0.5), fixed.latency_ms(0.99),
                   cores["api"] * per_command, cores["processor"] * per_command)
    finally:
        cluster.stop_all()


def _summary(runs: list[Run]) -> None:
    off = [r for r in runs if not r.tracing]
    on = [r for r in runs if r.tracing]
    for what in ("api_us", "processor_us", "p50_ms", "p99_ms"):
        a, b = (statistics.median(getattr(r, what) for r in side) for side in (off, on))
        pairs = ", ".join(f"{getattr(y, what) / getattr(x, what):.2f}" for x, y in zip(off, on, strict=True))
        console.print(f"{what:>13}: off {a:,.1f}, on {b:,.1f}; ratio of medians {b / a:.2f} (per pair: {pairs})", highlight=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--rate", type=float, default=500, help="commands/s of each run's open loop")
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument("--accounts", type=int, default=2_000)
    parser.add_argument("--partitions", type=int, default=6)
    args = parser.parse_args()
    run_harness(run(args.pairs, args.rate, args.seconds, args.accounts, args.partitions))


if __name__ == "__main__":
    main()
