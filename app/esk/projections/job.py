"""Entry point for spark-submit (a cluster); locally, `esk project run` does the same.
deploy/spark/submit.sh passes this file to spark-submit, which runs it as a script: hence
absolute imports here, where the rest of esk imports relatively.
"""

from __future__ import annotations

import argparse
import os

from rich.console import Console

from esk.projections.catalog import configured_read_models, select_read_models
from esk.projections.runner import ColumnsChanged, RunFailed, run_several, stop_on_signals
from esk.settings import Settings


def main() -> None:
    settings = Settings()
    read_models = configured_read_models(settings)
    parser = argparse.ArgumentParser(description="Run esk read models under spark-submit, together in one driver.")
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"of {', '.join(sorted(read_models))}")
    parser.add_argument("--all", action="store_true", dest="every", help="every read model the project has")
    parser.add_argument("--continuous", action="store_true")
    parser.add_argument("--rebuild", action="store_true")
    args = parser.parse_args()
    try:
        chosen = select_read_models(read_models, args.names, args.every)
    except ValueError as error:
        parser.error(str(error))
    os.environ["ESK_SPARK_SUBMITTED"] = "1"  # the master comes from spark-submit, not from settings
    console = Console(stderr=True)
    stop = stop_on_signals(console)
    try:
        summaries = run_several(settings, chosen, continuous=args.continuous, rebuild=args.rebuild, console=console, stop=stop)
    except RunFailed as failed:
        if isinstance(failed.error, ColumnsChanged):
            raise SystemExit(f"{failed}: run it with --rebuild to build a table of its new columns from the events") from None
        raise failed.error from None
    # as `esk project run`: a run stopped before it caught up left readers where they were
    if not args.continuous and not all(summary.caught_up for summary in summaries):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
