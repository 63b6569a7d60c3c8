"""The short variant of the crash harness (`make crash` runs 50 kills), with real
processes and real SIGKILLs against the suite's broker."""

from __future__ import annotations

from pathlib import Path

import pytest
from rich.console import Console

from app.settings import Settings
from bench import crash

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
    assert verdict.acknowledged > 100
    assert verdict.missing_outcomes == 0
    assert verdict.duplicate_outcomes == 0
    assert verdict.version_gaps_or_duplicates == 0
    assert verdict.events_not_matching_outcomes == 0
    assert verdict.state_mismatches == 0
    assert verdict.dlq == 0
    assert verdict.ok
