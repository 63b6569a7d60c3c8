"""State at scale (issue #4's bar): one processor builds N aggregates (default a million,
one `open` each) under a RocksDB memory budget; then its resident memory against the
budget, the time to ready after a clean stop, and after losing its state directory.

    python -m bench.state_scale [--aggregates N] [--budget-mb M]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from bench.cluster import Cluster, run_harness, scratch_broker, scratch_settings
from bench.measure import drain, restarts
from bench.results import Report, console
from bench.workload import account_ids, account_opens, command_records, produce
from esk.kafka.topics import TopicNames, ensure_topics, topic_specs
from esk.registry import load_registry


async def run(aggregates: int, budget_mb: int, partitions: int) -> Report:
    report = Report(aggregates, aggregates, partitions)
    async with scratch_broker("esk-state-scale") as broker:
        settings = scratch_settings(broker, "scale", partitions)
        names = TopicNames(settings.app)
        await ensure_topics(settings, topic_specs(settings, load_registry(settings.domain)))
        await produce(settings, names.commands, command_records(account_opens(account_ids(aggregates))))
        cluster = Cluster(settings, Path(tempfile.mkdtemp(prefix="esk-state-scale-")))
        processor = cluster.processor("processor", ESK_PROCESSOR__MEMORY_BUDGET_MB=str(budget_mb))
        try:
            built = await drain(settings, processor, f"{settings.app}.processor", names.commands, partitions, 3600)
            assert built.drained_after_s is not None and built.ready_after_s is not None
            processing_s = built.drained_after_s - built.ready_after_s
            report.add("W1", "esk processor, creating aggregates", aggregates / processing_s, "commands/s")
            report.add("W5", "esk processor max RSS", built.max_rss_mb, "MB", f"budget {budget_mb} MB")
            processor.stop()
            await restarts(settings, processor, partitions, account_ids(aggregates), report)
        finally:
            cluster.stop_all()
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--aggregates", type=int, default=1_000_000)
    parser.add_argument("--budget-mb", type=int, default=128)
    args = parser.parse_args()
    report = run_harness(run(args.aggregates, args.budget_mb, 6))
    for row in report.rows:
        console.print(f"{row.workload} {row.system}: {row.value:,.1f} {row.unit} {row.note}", highlight=False)
    rss = report.get("W5", "esk processor max RSS")
    if rss is not None:
        console.print(f"max RSS minus the RocksDB budget: {rss - args.budget_mb:.0f} MB (target <= 150)", highlight=False)


if __name__ == "__main__":
    main()
