"""Entry point for spark-submit (a cluster); locally, `esk project run` does the same.
deploy/spark/submit.sh passes this file to spark-submit, which runs it as a script: hence
absolute imports here, where the rest of esk imports relatively.
"""

from __future__ import annotations

import argparse
import os

from rich.console import Console

from esk.projections.catalog import configured_read_models
from esk.projections.runner import run, stop_on_signals
from esk.settings import Settings


def main() -> None:
    settings = Settings()
    read_models = configured_read_models(settings)
    parser = argparse.ArgumentParser(description="Run one esk projection under spark-submit.")
    parser.add_argument("name", choices=sorted(read_models))
    parser.add_argument("--continuous", action="store_true")
    parser.add_argument("--rebuild", action="store_true")
    args = parser.parse_args()
    os.environ["ESK_SPARK_SUBMITTED"] = "1"  # the master comes from spark-submit, not from settings
    console = Console(stderr=True)
    stop = stop_on_signals(console)
    run(settings, read_models[args.name], continuous=args.continuous, rebuild=args.rebuild, console=console, stop=stop)


if __name__ == "__main__":
    main()
