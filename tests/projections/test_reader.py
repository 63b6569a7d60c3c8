"""The API's reads of a read model (delta-rs, no Spark): filters as the columns' types, the
read model's order, at most `limit` rows, across the files of a table written batch by
batch."""

from __future__ import annotations

import random
from datetime import UTC, date, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pytest

deltalake = pytest.importorskip("deltalake")

import esk  # noqa: E402
from esk.projections.catalog import Tables  # noqa: E402
from esk.projections.reader import BadFilter, ReadModelNotBuilt, read_rows  # noqa: E402
from tests.counters import counters  # noqa: E402

RANKED = esk.ReadModel("ranked", (counters,), "counters by total, largest first", order_by=("-total", "counter_id"))
UNORDERED = esk.ReadModel("ranked", (counters,), "the same table, in no order")


def _rows(n: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [{"counter_id": f"c{seed}-{i}", "kind": rng.choice(["a", "b"]), "total": rng.randint(0, 20)} for i in range(n)]


@pytest.fixture
def written(tmp_path: Path) -> tuple[Tables, list[dict[str, Any]]]:
    """A table of five files (one a batch), as a read model's batches leave it."""
    tables = Tables(tmp_path / "warehouse")
    schema = pa.schema([("counter_id", pa.string()), ("kind", pa.string()), ("total", pa.int64())])
    everything: list[dict[str, Any]] = []
    for seed in range(5):
        batch = _rows(40, seed)
        deltalake.write_deltalake(str(tables.path("ranked", 1)), pa.Table.from_pylist(batch, schema), mode="append")
        everything += batch
    tables.switch("ranked", 1)
    return tables, everything


def _in_order(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted(rows, key=lambda r: (-r["total"], r["counter_id"]))


@pytest.mark.parametrize("limit", [1, 7, 200, 1000])
def test_the_first_rows_in_the_read_model_s_order_across_every_file(written: tuple[Tables, list[dict[str, Any]]], limit: int) -> None:
    tables, everything = written
    assert read_rows(tables, RANKED, {}, limit) == _in_order(everything)[:limit]
    kind_b = [r for r in everything if r["kind"] == "b"]
    assert read_rows(tables, RANKED, {"kind": "b"}, limit) == _in_order(kind_b)[:limit]


def test_without_an_order_at_most_limit_rows_that_match(written: tuple[Tables, list[dict[str, Any]]]) -> None:
    tables, everything = written
    some = read_rows(tables, UNORDERED, {"total": "7"}, 3)
    matching = [r for r in everything if r["total"] == 7]
    assert len(some) == min(3, len(matching)) and all(r in matching for r in some)
    assert sorted(read_rows(tables, UNORDERED, {"total": "7"}, 1000), key=str) == sorted(matching, key=str)


def test_a_filter_on_no_such_column_or_of_the_wrong_type_is_refused(written: tuple[Tables, list[dict[str, Any]]], tmp_path: Path) -> None:
    tables, _ = written
    with pytest.raises(BadFilter, match="no column 'nope'"):
        read_rows(tables, RANKED, {"nope": "1"}, 10)
    with pytest.raises(BadFilter, match=r"^total: 'many' is not a whole number a 64-bit column holds$"):
        read_rows(tables, RANKED, {"total": "many"}, 10)
    for beyond in (str(2**63), str(-(2**63) - 1)):  # no int64 holds it (schemathesis found a 500)
        with pytest.raises(BadFilter, match=rf"^total: '{beyond}' is not a whole number a 64-bit column holds$"):
            read_rows(tables, RANKED, {"total": beyond}, 10)
    with pytest.raises(ReadModelNotBuilt):
        read_rows(Tables(tmp_path / "empty"), RANKED, {}, 10)


def test_an_order_its_table_cannot_give_is_told_in_the_read_model_s_words(written: tuple[Tables, list[dict[str, Any]]]) -> None:
    """The read model's code now orders by a column its table, built by earlier code, does
    not have: said so (the API answered with pyarrow's own words), not read in some order."""
    tables, _ = written
    changed = esk.ReadModel("ranked", (counters,), "ranked by a column it never had", order_by=("-member", "counter_id"))
    with pytest.raises(LookupError, match=r"^ranked's order_by names member, which its current table does not have \(its columns: "
                       r"counter_id, kind, total\); `esk project run ranked` tells what its code declares$"):
        read_rows(tables, changed, {}, 10)


def test_a_timestamp_filter_without_an_offset_is_read_as_utc(tmp_path: Path) -> None:
    """Spark writes a TIMESTAMP as an instant in UTC; the rows show it so, and a filter
    given as they show it, or without an offset at all, finds it."""
    tables = Tables(tmp_path / "warehouse")
    placed = pa.array([datetime(2026, 11, 26, 14, 38, 52, 965000, tzinfo=UTC), datetime(2026, 11, 27, tzinfo=UTC)], pa.timestamp("us", tz="UTC"))
    deltalake.write_deltalake(str(tables.path("orders", 1)), pa.table({"order_id": ["o1", "o2"], "placed_at": placed}))
    tables.switch("orders", 1)
    orders = esk.ReadModel("orders", (counters,), "orders", order_by=("order_id",))
    [row] = read_rows(tables, orders, {"order_id": "o1"}, 10)
    assert row["placed_at"] == "2026-11-26T14:38:52.965000+00:00"
    for given in (row["placed_at"], "2026-11-26T14:38:52.965", "2026-11-26T14:38:52.965Z", "2026-11-26T15:38:52.965+01:00"):
        assert read_rows(tables, orders, {"placed_at": given}, 10) == [row], given
    assert [r["order_id"] for r in read_rows(tables, orders, {"placed_at": "2026-11-27"}, 10)] == ["o2"]  # midnight
    with pytest.raises(BadFilter, match=r"'yesterday' is not a date and time in ISO 8601 \(2025-06-01T09:30:00Z\)$"):
        read_rows(tables, orders, {"placed_at": "yesterday"}, 10)
    # a TIMESTAMP_NTZ column (a wall-clock time, no zone) compares as given
    wall = pa.array([datetime(2026, 11, 26, 14, 38), datetime(2026, 11, 27)], pa.timestamp("us"))
    deltalake.write_deltalake(str(tables.path("orders", 2)), pa.table({"order_id": ["o1", "o2"], "placed_at": wall}))
    tables.switch("orders", 2)
    for given in ("2026-11-26T14:38:00", "2026-11-26T14:38:00Z"):
        assert [r["order_id"] for r in read_rows(tables, orders, {"placed_at": given}, 10)] == ["o1"], given


def test_boolean_and_decimal_columns_are_filtered_as_json_writes_them_and_an_unfilterable_one_is_refused(tmp_path: Path) -> None:
    tables = Tables(tmp_path / "warehouse")
    table = pa.table({
        "item_id": ["i1", "i2"],
        "discontinued": [True, False],
        "price": pa.array([Decimal("1.00"), Decimal("2.50")], pa.decimal128(10, 2)),
        "tags": [["a"], ["b"]],
    })  # fmt: skip
    deltalake.write_deltalake(str(tables.path("items", 1)), table)
    tables.switch("items", 1)
    items = esk.ReadModel("items", (counters,), "items", order_by=("item_id",))
    assert [r["item_id"] for r in read_rows(tables, items, {"discontinued": "true"}, 10)] == ["i1"]
    assert [r["item_id"] for r in read_rows(tables, items, {"discontinued": "false"}, 10)] == ["i2"]
    with pytest.raises(BadFilter, match=r"^discontinued: 'yes' is not true or false$"):
        read_rows(tables, items, {"discontinued": "yes"}, 10)
    for given in ("2.5", "2.50", "-0", "1"):
        expected = {"2.5": ["i2"], "2.50": ["i2"], "-0": [], "1": ["i1"]}[given]
        assert [r["item_id"] for r in read_rows(tables, items, {"price": given}, 10)] == expected, given
    # as /openapi.json's pattern states: digits, no exponent; and no more places than the column holds
    for given in ("2.505", "1e2", "NaN", "twelve", "123456789012"):
        with pytest.raises(BadFilter, match=rf"^price: '{given}' is not a decimal number a decimal\(10,2\) column holds$"):
            read_rows(tables, items, {"price": given}, 10)
    # pyarrow compares no string with it: refused, as /openapi.json leaves it out
    with pytest.raises(BadFilter, match=r"^tags is a list<element: string> column: rows are not filtered on one$"):
        read_rows(tables, items, {"tags": "a"}, 10)


def test_rows_answer_as_json_holds_each_column(tmp_path: Path) -> None:
    """Decimals as their exact text (a JSON number reaches most clients as a double), binary
    as base64, dates and times in ISO 8601, maps as objects, structs and arrays by their parts,
    nulls as null at every depth (the API answered 500 to a row with a decimal or binary)."""
    tables = Tables(tmp_path / "warehouse")
    line = pa.struct([("sku", pa.string()), ("price", pa.decimal128(12, 4)), ("due", pa.date32())])
    table = pa.table({
        "order_id": ["o1", "o2"],
        "total": pa.array([Decimal("0.00"), None], pa.decimal128(10, 2)),
        "raw": pa.array([b"\x00\xffesk", None], pa.binary()),
        "lines": pa.array([[{"sku": "s1", "price": Decimal("1.5"), "due": date(2026, 12, 1)}, None], None], pa.list_(line)),
        "counts": pa.array([[("a", 1), ("b", None)], None], pa.map_(pa.string(), pa.int64())),
        "by_day": pa.array([[(date(2026, 1, 2), Decimal("3"))], []], pa.map_(pa.date32(), pa.decimal128(5, 1))),
        "at": pa.array([datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC), None], pa.timestamp("us", tz="UTC")),
    })  # fmt: skip
    deltalake.write_deltalake(str(tables.path("orders", 1)), table)
    tables.switch("orders", 1)
    rows = read_rows(tables, esk.ReadModel("orders", (counters,), "orders", order_by=("order_id",)), {}, 10)
    assert rows == [
        {
            "order_id": "o1",
            "total": "0.00",
            "raw": "AP9lc2s=",
            "lines": [{"sku": "s1", "price": "1.5000", "due": "2026-12-01"}, None],
            "counts": {"a": 1, "b": None},
            "by_day": {"2026-01-02": "3.0"},
            "at": "2026-01-02T03:04:05+00:00",
        },
        {"order_id": "o2", "total": None, "raw": None, "lines": None, "counts": None, "by_day": {}, "at": None},
    ]
    assert orjson.loads(orjson.dumps(rows)) == rows


# A read that answers from the first rows, then the process's end at once (an API pod
# stopped right after a read): pyarrow's head() reads on in the background, and through
# delta-rs's filesystem (Python, called from Arrow's I/O threads) the process crashed or
# hung in the interpreter's teardown.
READ_THEN_EXIT = """
import sys
from pathlib import Path
import esk
from esk.projections.catalog import Tables
from esk.projections.reader import read_rows
from tests.counters import counters
unordered = esk.ReadModel("ranked", (counters,), "in no order")
print(len(read_rows(Tables(Path(sys.argv[1])), unordered, {}, 100)))
"""


def test_a_process_that_reads_then_exits_at_once_exits_cleanly(tmp_path: Path) -> None:
    import subprocess
    import sys

    tables = Tables(tmp_path / "warehouse")
    for part in range(8):
        ids = [f"c{part}-{i}" for i in range(50_000)]
        columns = {"counter_id": ids, "kind": ["a"] * len(ids), "total": list(range(len(ids)))}
        deltalake.write_deltalake(str(tables.path("ranked", 1)), pa.table(columns), mode="append")
    tables.switch("ranked", 1)
    for _ in range(3):
        done = subprocess.run(
            [sys.executable, "-c", READ_THEN_EXIT, str(tables.warehouse)], cwd=Path(__file__).parents[2], capture_output=True, text=True, timeout=60
        )
        assert (done.returncode, done.stdout) == (0, "100\n"), done.stderr[-2000:]
