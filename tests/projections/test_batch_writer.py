"""BatchWriter's delta-rs path without Spark: a batch written once is skipped when it runs
again (after a crash), batch 0 included, and the next batch is written."""

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
