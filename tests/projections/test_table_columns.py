"""A read model whose declared columns no longer match its table is refused at start, with
what changed, before any batch is written into it (no Spark: the table is delta-rs's)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import pyarrow as pa
import pytest

deltalake = pytest.importorskip("deltalake")
types = pytest.importorskip("pyspark.sql.types")

from esk.projections.runner import ColumnsChanged, _create_table  # noqa: E402

LINE = types.StructType([types.StructField("sku", types.StringType()), types.StructField("qty", types.LongType())])


def declared(*fields: Any) -> Any:
    return types.StructType(list(fields))


def table(path: Path) -> Path:
    line = pa.struct([("sku", pa.string()), ("qty", pa.int64())])
    rows = pa.table({"order_id": pa.array(["o1"]), "total": pa.array([5], pa.int64()), "lines": pa.array([[]], pa.list_(line))})
    deltalake.write_deltalake(str(path), rows)
    return path


def test_the_same_columns_in_another_order_are_the_table_s(tmp_path: Path) -> None:
    path = table(tmp_path / "t")
    same = declared(
        types.StructField("total", types.LongType(), nullable=False),
        types.StructField("lines", types.ArrayType(LINE)),
        types.StructField("order_id", types.StringType()),
    )
    _create_table(cast(Any, None), path, same, ())  # an existing table: no Spark asked


def test_changed_columns_are_refused_with_what_changed(tmp_path: Path) -> None:
    path = table(tmp_path / "t")
    changed = declared(
        types.StructField("order_id", types.StringType()),
        types.StructField("total", types.StringType()),
        types.StructField("lines", types.ArrayType(types.StructType([types.StructField("sku", types.StringType())]))),
        types.StructField("status", types.StringType()),
    )
    with pytest.raises(ColumnsChanged) as refused:
        _create_table(cast(Any, None), path, changed, ())
    message = str(refused.value)
    assert "status is new" in message
    assert "total was bigint, now string" in message
    assert "lines was array<struct<sku:string,qty:bigint>>, now array<struct<sku:string>>" in message
    dropped = declared(types.StructField("order_id", types.StringType()), types.StructField("total", types.LongType()))
    with pytest.raises(ColumnsChanged, match="lines is gone"):
        _create_table(cast(Any, None), path, dropped, ())
    assert deltalake.DeltaTable(str(path)).version() == 0  # nothing written to it
