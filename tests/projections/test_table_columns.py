"""A read model whose declared columns or partitioning no longer match its table: refused,
with what changed, for the generation readers use; started over for one still being
built, as a rebuild would otherwise find its own half-built table of the old columns (no
Spark: the tables are delta-rs's)."""

from __future__ import annotations

import json
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

deltalake = pytest.importorskip("deltalake")
types = pytest.importorskip("pyspark.sql.types")

from esk.projections.catalog import ReadModel, Tables  # noqa: E402
from esk.projections.runner import ReadModelChanged, ReadModelInvalid, RunFailed, _table_fits  # noqa: E402

MODEL = ReadModel("orders", (), "the orders")  # reads nothing here: only its table is looked at
LINE = types.StructType([types.StructField("sku", types.StringType()), types.StructField("qty", types.LongType())])


def kept() -> None:
    pytest.fail("a generation that fits, or one readers use, was started over")


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
    assert _table_fits(table(tmp_path / "t"), kept, SAME, MODEL, read=True)
    assert _table_fits(tmp_path / "t", kept, SAME, MODEL, read=False)
    assert not _table_fits(tmp_path / "none", kept, SAME, MODEL, read=True)


def test_a_read_generation_of_other_columns_is_refused_with_what_changed(tmp_path: Path) -> None:
    path = table(tmp_path / "t")
    with pytest.raises(ReadModelChanged) as refused:
        _table_fits(path, kept, CHANGED, MODEL, read=True)
    message = str(refused.value)
    assert "status is new" in message
    assert "total was bigint, now string" in message
    assert "lines was array<struct<sku:string,qty:bigint>>, now array<struct<sku:string>>" in message
    # what `esk project run` and the spark-submit job say, with the way out
    assert str(RunFailed("orders", refused.value)) == (
        f"orders: {message}: rebuild that read model alone (`esk project run orders --rebuild`, or the spark-submit job with "
        "`orders --rebuild`), which builds its table again from the events, as a continuous run (`esk dev`'s among them) does on its own"
    )
    dropped = declared(types.StructField("order_id", types.StringType()), types.StructField("total", types.LongType()))
    with pytest.raises(ReadModelChanged, match="lines is gone"):
        _table_fits(path, kept, dropped, MODEL, read=True)
    with pytest.raises(ReadModelChanged, match=r"partitioned by \(\), now by \(order_id\)"):
        _table_fits(path, kept, SAME, replace(MODEL, partition_by=("order_id",)), read=True)
    assert deltalake.DeltaTable.is_deltatable(str(path))


def test_a_generation_being_built_of_other_columns_starts_over(tmp_path: Path) -> None:
    tables = Tables(tmp_path)
    path, checkpoint = table(tables.path(MODEL.name, 2)), tables.checkpoint(MODEL.name, 2)
    (checkpoint / "offsets").mkdir(parents=True)
    assert not _table_fits(path, partial(tables.start_over, MODEL.name, 2), CHANGED, MODEL, read=False)
    assert not path.exists() and not checkpoint.exists()


def test_a_table_built_by_another_version_of_the_read_model_is_one_of_other_columns(tmp_path: Path) -> None:
    path = table(tmp_path / "t")  # written before versions were recorded: version 1
    assert _table_fits(path, kept, SAME, MODEL, read=True)
    with pytest.raises(ReadModelChanged, match=r"\(version 1, now 2\)$"):
        _table_fits(path, kept, SAME, replace(MODEL, version=2), read=True)
    _built_by(table(tmp_path / "v2"), version=2)
    assert _table_fits(tmp_path / "v2", kept, SAME, replace(MODEL, version=2), read=True)
    with pytest.raises(ReadModelChanged, match=r"\(status is new; version 2, now 3\)$"):
        _table_fits(tmp_path / "v2", kept, declared(*SAME.fields, types.StructField("status", types.StringType())), replace(MODEL, version=3), read=True)
    for wrong in (0, -1, True, "2"):
        with pytest.raises(ValueError, match="a read model's version is a whole number from 1"):
            replace(MODEL, version=wrong)


def test_a_read_generation_built_by_other_writes_at_the_same_version_is_refused(tmp_path: Path) -> None:
    """A Merge's expression changed (`t.total + s.n` to `t.total + 2 * s.n`, say) and not
    its columns: the rows there were merged the old way, and would be merged the new way
    onto them, unless the read model's version is raised."""
    tables = Tables(tmp_path)
    path, checkpoint = table(tables.path(MODEL.name, 1)), tables.checkpoint(MODEL.name, 1)
    _built_by(path, version=1, writes="aaaa")
    assert _table_fits(path, kept, SAME, MODEL, read=True, writes="aaaa")
    assert _table_fits(path, kept, SAME, MODEL, read=True, writes=None)  # its code wants rows to get to its writes
    with pytest.raises(ReadModelInvalid, match=r"its writes are not those its table at .* was built with .*raise its ReadModel.version"):
        _table_fits(path, kept, SAME, MODEL, read=True, writes="bbbb")
    # a version raised with it: the columns' way (a continuous run builds it beside)
    with pytest.raises(ReadModelChanged, match=r"\(version 1, now 2\)$"):
        _table_fits(path, kept, SAME, replace(MODEL, version=2), read=True, writes="bbbb")
    # a table that knows no writes (built before they were noted) fits: it is given them
    assert _table_fits(table(tmp_path / "older"), kept, SAME, MODEL, read=True, writes="bbbb")
    # one still being built starts over
    (checkpoint / "offsets").mkdir(parents=True)
    assert not _table_fits(path, partial(tables.start_over, MODEL.name, 1), SAME, MODEL, read=False, writes="bbbb")
    assert not path.exists() and not checkpoint.exists()


def _built_by(path: Path, version: int, writes: str | None = None) -> None:
    """The table's first commit as Spark writes it for a read model of `version` (delta-rs
    creates no table with a property it does not know, though it reads and writes one)."""
    log = path / "_delta_log" / "00000000000000000000.json"
    actions = [json.loads(line) for line in log.read_text().splitlines()]
    for action in actions:
        if "metaData" in action:
            action["metaData"]["configuration"]["esk.readModel.version"] = str(version)
            if writes is not None:
                action["metaData"]["configuration"]["esk.readModel.writes"] = writes
    log.write_text("".join(json.dumps(action) + "\n" for action in actions))
