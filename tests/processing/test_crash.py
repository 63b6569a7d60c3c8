"""The short variant of the crash harness (`make crash` runs 50 kills), with real
processes and real SIGKILLs against the suite's broker."""

from __future__ import annotations

from pathlib import Path

import pytest
from rich.console import Console

from bench import crash
from esk.settings import Settings

pytestmark = pytest.mark.kafka


async def test_sigkill_under_load_loses_and_duplicates_nothing(settings: Settings, tmp_path: Path) -> None:
    verdict = await crash.run(
        settings,
        tmp_path / "crash",
        kills=4,
        rate=60,
        accounts=20,
        min_gap_s=0.5,
        max_gap_s=2.5,
        wipe_every=2,
        seed=3,
        console=Console(),
    )
    print(verdict.notes)
    # enough commands around the kills to mean something (a slow machine, its processor
    # restarting for longer, acknowledges fewer of the same load)
    assert verdict.acknowledged > 50
    # no missing or duplicate outcome, version gap, event without its outcome, state
    # mismatch or DLQ record
    assert verdict.ok, vars(verdict)
