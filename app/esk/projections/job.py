"""Entry point for spark-submit (a cluster); locally, `esk project run` does the same.
deploy/spark/submit.sh passes this file to spark-submit, which runs it as a script: hence
absolute imports here, where the rest of esk imports relatively.
"""

from __future__ import annotations

import argparse
import os

from rich.console import Console

from esk.logs import configure_logging
from esk.projections.catalog import configured_read_models, select_read_models
from esk.projections.runner import RunFailed, run_and_report, stop_on_signals
from esk.settings import SettingsInvalid, read_settings


def main() -> None:
    try:
        settings = read_settings()
    except SettingsInvalid as error:
        raise SystemExit(f"error: {error}") from None
    configure_logging(settings.log_level, settings.log_format)
    read_models = configured_read_models(settings)
    parser = argparse.ArgumentParser(description="Run esk read models under spark-submit, together in one driver.")
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"of {', '.join(sorted(read_models))}")
    parser.add_argument("--all", action="store_true", dest="every", help="every read model the project has")
    parser.add_argument("--continuous", action="store_true")
    parser.add_argument("--rebuild", action="store_true")
    parser.add_argument("--leave-out-invalid", action="store_true", help="as `esk project run --leave-out-invalid`")
    args = parser.parse_args()
    try:
        chosen = select_read_models(read_models, args.names, args.every)
    except ValueError as error:
        parser.error(str(error))
    os.environ["ESK_SPARK_SUBMITTED"] = "1"  # the master comes from spark-submit, not from settings
    console = Console(stderr=True, soft_wrap=True, emoji=False)
    try:
        code = run_and_report(settings, chosen, args.continuous, args.rebuild, console, stop_on_signals(), args.leave_out_invalid)
    except RunFailed as failed:
        if failed.told_in_a_line:
            raise SystemExit(str(failed)) from None
        raise failed.error from None  # its traceback, for the driver's log
    raise SystemExit(code)


if __name__ == "__main__":
    main()
