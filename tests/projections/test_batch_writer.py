"""BatchWriter's delta-rs path without Spark: a batch written once is skipped when it runs
again (after a crash), batch 0 included, and the next batch is written; a lookup reads
only the rows of its keys."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import pyarrow as pa
import pytest

deltalake = pytest.importorskip("deltalake")

from esk.projections.catalog import BatchWriter  # noqa: E402


class Rows:
    """What the delta-rs path takes of a DataFrame: its rows as Arrow."""

    def __init__(self, *values: int) -> None:
        self.table = pa.table({"n": pa.array(values, pa.int64())})

    def toArrow(self) -> pa.Table:  # Spark's name
        return self.table


def writer(path: Path, batch_id: int) -> BatchWriter:
    return BatchWriter(cast(Any, None), "esk.app.model.g1", batch_id, str(path), on_driver=True)


def test_a_batch_run_again_writes_nothing_twice(tmp_path: Path) -> None:
    path = tmp_path / "table"
    deltalake.write_deltalake(str(path), Rows().table)
    assert writer(path, 0).append(cast(Any, Rows(1, 2))) == 2
    assert writer(path, 0).append(cast(Any, Rows(1, 2))) == 0  # batch 0 again: skipped
    assert writer(path, 1).append(cast(Any, Rows(3))) == 1
    assert writer(path, 1).append(cast(Any, Rows(3))) == 0
    assert sorted(deltalake.DeltaTable(str(path)).to_pyarrow_table()["n"].to_pylist()) == [1, 2, 3]


def test_a_lookup_reads_only_the_rows_of_the_keys_as_the_tables_types(tmp_path: Path) -> None:
    from pyspark.sql.types import LongType, StringType, StructField, StructType

    from esk.projections.catalog import _driver_lookup

    path = str(tmp_path / "table")
    # delta-rs writes strings as string_view: the lookup must still match them, and give
    # them back as the table's (Spark's) string.
    rows = pa.table({"customer_id": pa.array(["a", "b", "a", "c"], pa.string_view()), "order_id": ["1", "2", "3", "4"], "n": [1, 2, 3, 4]})
    deltalake.write_deltalake(path, rows)
    schema = StructType([StructField("customer_id", StringType()), StructField("order_id", StringType()), StructField("n", LongType())])

    found = _driver_lookup(path, pa.table({"customer_id": ["a", "x"]}), schema)
    assert sorted(found["order_id"].to_pylist()) == ["1", "3"]
    assert found.schema.field("customer_id").type == pa.string()

    both = _driver_lookup(path, pa.table({"customer_id": ["a", "b"], "order_id": ["3", "9"]}), schema)
    assert sorted(both["order_id"].to_pylist()) == ["3"]  # each column filtered: a superset, exact for these

    nothing = _driver_lookup(path, pa.table({"customer_id": pa.array([], pa.string())}), schema)
    assert nothing.num_rows == 0 and nothing.schema.names == ["customer_id", "order_id", "n"]
