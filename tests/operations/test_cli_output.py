"""What the command line prints rows as (`esk sql`, `esk project list`, …)."""

from __future__ import annotations

import pytest

from esk.cli import print_rows


def test_csv_writes_booleans_and_nulls_as_sql_and_json_read_them(capsys: pytest.CaptureFixture[str]) -> None:
    print_rows(["item_id", "discontinued", "lot"], [["i1", True, None], ["i2", False, "L7"]], "csv")
    assert capsys.readouterr().out.splitlines() == ["item_id,discontinued,lot", "i1,true,", "i2,false,L7"]
