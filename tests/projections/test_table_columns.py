"""A read model whose declared columns or partitioning no longer match its table: refused,
with what changed, for the generation readers use; started over for one still being
built, as a rebuild would otherwise find its own half-built table of the old columns (no
Spark: the tables are delta-rs's)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

deltalake = pytest.importorskip("deltalake")
types = pytest.importorskip("pyspark.sql.types")

from esk.projections.runner import ColumnsChanged, RunFailed, _table_fits  # noqa: E402

LINE = types.StructType([types.StructField("sku", types.StringType()), types.StructField("qty", types.LongType())])


def declared(*fields: Any) -> Any:
    return types.StructType(list(fields))


def table(path: Path) -> Path:
    line = pa.struct([("sku", pa.string()), ("qty", pa.int64())])
    rows = pa.table({"order_id": pa.array(["o1"]), "total": pa.array([5], pa.int64()), "lines": pa.array([[]], pa.list_(line))})
    deltalake.write_deltalake(str(path), rows)
    return path


SAME = declared(
    types.StructField("total", types.LongType(), nullable=False),
    types.StructField("lines", types.ArrayType(LINE)),
    types.StructField("order_id", types.StringType()),
)
CHANGED = declared(
    types.StructField("order_id", types.StringType()),
    types.StructField("total", types.StringType()),
    types.StructField("lines", types.ArrayType(types.StructType([types.StructField("sku", types.StringType())]))),
    types.StructField("status", types.StringType()),
)


def test_the_same_columns_in_another_order_fit(tmp_path: Path) -> None:
    checkpoint = tmp_path / "checkpoint"
    assert _table_fits(table(tmp_path / "t"), checkpoint, SAME, (), read=True)
    assert _table_fits(tmp_path / "t", checkpoint, SAME, (), read=False)
    assert not _table_fits(tmp_path / "none", checkpoint, SAME, (), read=True)


def test_a_read_generation_of_other_columns_is_refused_with_what_changed(tmp_path: Path) -> None:
    path = table(tmp_path / "t")
    with pytest.raises(ColumnsChanged) as refused:
        _table_fits(path, tmp_path / "checkpoint", CHANGED, (), read=True)
    message = str(refused.value)
    assert "status is new" in message
    assert "total was bigint, now string" in message
    assert "lines was array<struct<sku:string,qty:bigint>>, now array<struct<sku:string>>" in message
    # what `esk project run` and the spark-submit job say, with the way out
    assert str(RunFailed("orders", refused.value)) == (
        f"orders: {message}: rebuild that read model alone (`esk project run orders --rebuild`, or the spark-submit job with "
        "`orders --rebuild`), which builds a table of its new columns from the events"
    )
    dropped = declared(types.StructField("order_id", types.StringType()), types.StructField("total", types.LongType()))
    with pytest.raises(ColumnsChanged, match="lines is gone"):
        _table_fits(path, tmp_path / "checkpoint", dropped, (), read=True)
    with pytest.raises(ColumnsChanged, match=r"partitioned by \(\), now by \(order_id\)"):
        _table_fits(path, tmp_path / "checkpoint", SAME, ("order_id",), read=True)
    assert deltalake.DeltaTable.is_deltatable(str(path))


def test_a_generation_being_built_of_other_columns_starts_over(tmp_path: Path) -> None:
    path, checkpoint = table(tmp_path / "g2"), tmp_path / "checkpoints" / "g2"
    (checkpoint / "offsets").mkdir(parents=True)
    assert not _table_fits(path, checkpoint, CHANGED, (), read=False)
    assert not path.exists() and not checkpoint.exists()
