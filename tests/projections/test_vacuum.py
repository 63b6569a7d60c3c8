"""Delta upkeep (a continuous run's hourly VACUUM, the compaction every 50 batches): a
failure of it is told and the run goes on. It ended the run, or failed the batch, leaving a
read model unkept for a step that can wait its next turn."""

from __future__ import annotations

import logging
from pathlib import Path

import pyarrow as pa
import pytest
from deltalake import write_deltalake

from esk.projections.runner import _compact, _vacuum


def test_upkeep_that_fails_is_told_not_raised(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="esk.projections.runner"):
        _vacuum("totals", str(tmp_path / "not-a-table"))
        _compact("totals", str(tmp_path / "not-a-table"))
    assert "totals: removing the files its table no longer refers to failed (tried again later)" in caplog.text
    assert "totals: compacting its table's small files failed (tried again later)" in caplog.text


def test_upkeep_of_a_table_says_nothing(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    table = tmp_path / "totals"
    write_deltalake(str(table), pa.table({"day": ["2026-11-28"], "orders": [1]}))
    write_deltalake(str(table), pa.table({"day": ["2026-11-28"], "orders": [2]}), mode="overwrite")
    with caplog.at_level(logging.WARNING, logger="esk.projections.runner"):
        _vacuum("totals", str(table))
        _compact("totals", str(table))
    assert caplog.text == ""
    assert len(list(table.glob("*.parquet"))) == 2  # within the retention: both kept
