"""Entry point for spark-submit (a cluster); locally, `esk project run` does the same.

    spark-submit --master spark://HOST:7077 --jars <deploy/spark jars> \\
        --py-files esk.zip projections/job.py customer_recent_orders --continuous
"""

from __future__ import annotations

import argparse
import os

from app.settings import Settings
from projections.read_models import PROJECTIONS
from projections.runner import run


def main() -> None:
    parser = argparse.ArgumentParser(description="Run one esk projection under spark-submit.")
    parser.add_argument("name", choices=sorted(PROJECTIONS))
    parser.add_argument("--continuous", action="store_true")
    parser.add_argument("--rebuild", action="store_true")
    args = parser.parse_args()
    os.environ["ESK_SPARK_SUBMITTED"] = "1"  # the master comes from spark-submit, not from settings
    run(Settings(), PROJECTIONS[args.name], continuous=args.continuous, rebuild=args.rebuild)


if __name__ == "__main__":
    main()
