"""The processor's handling cost alone: microseconds per command through StreamTask.process
on a RocksDB store, no Kafka (the accounts workload of W1). Steadier than W1 on a noisy
machine, so it is where changes to the command path are compared first.

    python -m bench.handling [--commands N] [--accounts M]
"""

from __future__ import annotations

import argparse
import gc
import tempfile
import time
from pathlib import Path

from aiokafka.structs import ConsumerRecord

from bench.results import console
from bench.workload import accounts_commands, command_records
from esk.kafka.topics import TopicNames
from esk.processing.stream_task import StreamTask
from esk.registry import load_registry
from esk.settings import Settings
from esk.state.resources import StoreResources
from esk.state.store import RocksDBStore

CHUNK = 64  # what the processor hands StreamTask.process at a time (task_manager.YIELD_EVERY)
BATCH = 1000  # commands between store writes, as batch_max_records


def microseconds_per_command(commands: int, accounts: int, budget_mb: int) -> float:
    settings = Settings(_env_file=None)
    topics = TopicNames("handling")
    store = RocksDBStore(Path(tempfile.mkdtemp(prefix="esk-handling-")) / "store", StoreResources(budget_mb))
    task = StreamTask(0, topics, load_registry(settings.domain), store, 0, dedup_window_ms=3_600_000)
    records = [
        ConsumerRecord(topics.commands, 0, offset, 0, 0, key, value, None, len(key), len(value), ())
        for offset, (key, value) in enumerate(command_records(accounts_commands(commands, accounts, seed=42)))
    ]
    gc.collect()
    started = time.perf_counter()
    for start in range(0, len(records), BATCH):
        for chunk in range(start, min(start + BATCH, len(records)), CHUNK):
            task.process(records[chunk:min(chunk + CHUNK, start + BATCH)])
        # what a commit does to the task and its store, without the transaction
        task.committed(task.seal(), {})
    elapsed = time.perf_counter() - started
    store.close()
    return elapsed / len(records) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--commands", type=int, default=200_000)
    parser.add_argument("--accounts", type=int, default=20_000)
    parser.add_argument("--budget-mb", type=int, default=128)
    args = parser.parse_args()
    cost = microseconds_per_command(args.commands, args.accounts, args.budget_mb)
    console.print(f"{cost:.1f} us per command handled ({args.commands:,} commands over {args.accounts:,} accounts, no Kafka)")


if __name__ == "__main__":
    main()
