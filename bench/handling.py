"""The processor's handling cost alone: microseconds per command through StreamTask.process
on a RocksDB store, no Kafka (the accounts workload of W1). Steadier than W1 on a noisy
machine, so it is where changes to the command path are compared first.

    python -m bench.handling [--commands N] [--accounts M] [--tracing-pairs P]

`--tracing-pairs`: the same, alternating tracing off and on in one process, with every span
exported over OTLP/HTTP (to a sink that keeps nothing) and every command record carrying a
`traceparent` as the API's do; CPU time of the whole process (the exporter's thread too).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from aiokafka.structs import ConsumerRecord

from bench.results import console
from bench.tracing_overhead import OtlpSink
from bench.workload import accounts_commands, command_records
from esk.kafka.topics import TopicNames
from esk.processing.stream_task import StreamTask
from esk.registry import load_registry
from esk.settings import Settings
from esk.state.resources import StoreResources
from esk.state.store import RocksDBStore

CHUNK = 64  # what the processor hands StreamTask.process at a time (task_manager.YIELD_EVERY)
BATCH = 1000  # commands between store writes, as batch_max_records


def microseconds_per_command(
    commands: int, accounts: int, budget_mb: int, traced: bool = False,
    clock: Callable[[], float] = time.perf_counter, settle: Callable[[], object] = lambda: None,
) -> float:
    """`clock`: wall time, or the process's CPU time; `settle`: what has to be done before
    the clock stops (the exporter's last batch)."""
    settings = Settings(_env_file=None)
    topics = TopicNames("handling")
    store = RocksDBStore(Path(tempfile.mkdtemp(prefix="esk-handling-")) / "store", StoreResources(budget_mb))
    task = StreamTask(0, topics, load_registry(settings.domain), store, 0, dedup_window_ms=3_600_000, traced=traced)
    headers = (("traceparent", b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),) if traced else ()
    records = [
        ConsumerRecord(topics.commands, 0, offset, 0, 0, key, value, None, len(key), len(value), headers)
        for offset, (key, value) in enumerate(command_records(accounts_commands(commands, accounts, seed=42)))
    ]
    gc.collect()
    started = clock()
    for start in range(0, len(records), BATCH):
        for chunk in range(start, min(start + BATCH, len(records)), CHUNK):
            task.process(records[chunk:min(chunk + CHUNK, start + BATCH)])
        # what a commit does to the task and its store, without the transaction
        task.committed(task.seal(), {})
    settle()
    elapsed = clock() - started
    store.close()
    return elapsed / len(records) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--commands", type=int, default=200_000)
    parser.add_argument("--accounts", type=int, default=20_000)
    parser.add_argument("--budget-mb", type=int, default=128)
    parser.add_argument("--tracing-pairs", type=int, default=0)
    args = parser.parse_args()
    if args.tracing_pairs:
        tracing_pairs(args.tracing_pairs, args.commands, args.accounts, args.budget_mb)
        return
    cost = microseconds_per_command(args.commands, args.accounts, args.budget_mb)
    console.print(f"{cost:.1f} us per command handled ({args.commands:,} commands over {args.accounts:,} accounts, no Kafka)")


def tracing_pairs(pairs: int, commands: int, accounts: int, budget_mb: int) -> None:
    from opentelemetry import trace

    from esk.settings import TracingSettings
    from esk.tracing import tracer_provider

    with OtlpSink().serving() as sink:
        provider = tracer_provider(TracingSettings(enabled=True, endpoint=sink.traces_url), "bench-processor")
        assert provider is not None
        trace.set_tracer_provider(provider)
        cost: dict[bool, list[float]] = {False: [], True: []}
        for pair in range(pairs):
            for traced in (False, True) if pair % 2 == 0 else (True, False):
                us = microseconds_per_command(commands, accounts, budget_mb, traced, time.process_time, provider.force_flush)
                cost[traced].append(us)
                console.print(f"tracing {'on ' if traced else 'off'}: {us:.1f} us of CPU per command handled", highlight=False)
        provider.shutdown()
        ratios = ", ".join(f"{on / off:.2f}" for off, on in zip(cost[False], cost[True], strict=True))
        off, on = statistics.median(cost[False]), statistics.median(cost[True])
        console.print(f"medians: off {off:.1f}, on {on:.1f} us; on/off {on / off:.2f} (per pair: {ratios}); "
                      f"{sink.requests:,} exports, {sink.bytes / 1e6:.1f} MB", highlight=False)


if __name__ == "__main__":
    main()
