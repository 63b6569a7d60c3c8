"""What the command line prints rows as (`esk sql`, `esk project list`, …)."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from esk.cli import cli, named_in, print_rows


def test_csv_writes_booleans_and_nulls_as_sql_and_json_read_them(capsys: pytest.CaptureFixture[str]) -> None:
    print_rows(["item_id", "discontinued", "lot"], [["i1", True, None], ["i2", False, "L7"]], "csv")
    assert capsys.readouterr().out.splitlines() == ["item_id,discontinued,lot", "i1,true,", "i2,false,L7"]


def test_sql_loads_the_tables_its_query_names_alone() -> None:
    names = ["orders", "customer_recent_orders", "daily_order_totals"]
    assert named_in("SELECT * FROM Customer_Recent_Orders WHERE x = 1", names) == ["customer_recent_orders"]
    assert named_in("select o.id from `orders` o join daily_order_totals d on o.day = d.day", names) == ["orders", "daily_order_totals"]
    assert named_in("SELECT orders_2024.id FROM my_orders, orders$x", names) == []


def test_sql_with_no_read_models_says_so_before_sparks_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "no_models.py").write_text("READ_MODELS = []\n")
    monkeypatch.syspath_prepend(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ESK_READ_MODELS", "no_models:READ_MODELS")
    said = CliRunner().invoke(cli, ["sql", "SELECT * FROM customer_recent_orders"])
    assert said.exit_code == 1
    assert f"no read models to query: ESK_READ_MODELS=no_models:READ_MODELS names none (from {tmp_path})" in said.output
