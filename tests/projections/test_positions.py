"""Positions, without Kafka or Spark: their tokens, and what a streaming checkpoint says a
read model has read (the files Structured Streaming writes, in its format)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from esk.projections.catalog import Tables
from esk.projections.positions import Position, checkpoint_positions, read_model_positions, unreflected


@pytest.mark.parametrize("token", ["app.orders.events/3/1234", "a/b/with.slash/0/0"])
def test_a_token_reads_back_as_the_same_position(token: str) -> None:
    assert Position.parse(token).token() == token


@pytest.mark.parametrize("token", ["", "app.orders.events", "app.orders.events/3", "t/x/1", "t/1/-5", "/1/2", "t/01/2", "t/1/007", "t/²/1"])
def test_what_is_not_a_position_is_refused(token: str) -> None:
    with pytest.raises(ValueError, match="is not a position"):
        Position.parse(token)


def _batch(checkpoint: Path, batch: int, offsets: dict[str, dict[str, int]], finished: bool) -> None:
    (checkpoint / "offsets").mkdir(parents=True, exist_ok=True)
    (checkpoint / "commits").mkdir(parents=True, exist_ok=True)
    metadata = {"batchWatermarkMs": 0, "batchTimestampMs": 1, "conf": {}}
    (checkpoint / "offsets" / str(batch)).write_text("\n".join(["v1", json.dumps(metadata), json.dumps(offsets)]))
    if finished:
        (checkpoint / "commits" / str(batch)).write_text('v1\n{"nextBatchWatermarkMs":0}')


def test_a_read_model_reflects_its_last_finished_batch(tmp_path: Path) -> None:
    tables = Tables(tmp_path)
    assert read_model_positions(tables, "ledger") is None  # not built
    tables.switch("ledger", 2)
    checkpoint = tables.checkpoint("ledger", 2)
    assert read_model_positions(tables, "ledger") == {}  # built, nothing read yet
    _batch(checkpoint, 0, {"app.orders.events": {"0": 10, "1": 4}}, finished=True)
    _batch(checkpoint, 1, {"app.orders.events": {"0": 25, "1": 4}}, finished=True)
    # planned (its offsets written ahead), not finished: its writes may not be in the table
    _batch(checkpoint, 2, {"app.orders.events": {"0": 40, "1": 9}}, finished=False)
    positions = checkpoint_positions(checkpoint)
    assert positions == {("app.orders.events", 0): 25, ("app.orders.events", 1): 4}
    assert read_model_positions(tables, "ledger") == positions
    wanted = [Position("app.orders.events", 0, 25), Position("app.orders.events", 1, 5), Position("app.orders.events", 2, 1)]
    assert unreflected(positions, wanted) == wanted[1:]


def test_a_rebuild_is_behind_readers_only_on_a_partition_both_read(tmp_path: Path) -> None:
    """A one-shot rebuild, caught up, catches up again while readers' generation reflects
    more of a partition it reads (a one-shot run wrote it meanwhile); a topic only that one
    reads (the read model's categories were others) keeps it from nothing."""
    pytest.importorskip("pyspark")
    from esk.projections.runner import _behind_readers

    tables = Tables(tmp_path)
    _batch(tables.checkpoint("ledger", 2), 0, {"app.orders.events": {"0": 25, "1": 4}}, finished=True)
    assert not _behind_readers(tables, "ledger", 2)  # readers on none yet
    tables.switch("ledger", 1)
    _batch(tables.checkpoint("ledger", 1), 0, {"app.orders.events": {"0": 25, "1": 4}, "app.accounts.events": {"0": 7}}, finished=True)
    assert not _behind_readers(tables, "ledger", 2)
    _batch(tables.checkpoint("ledger", 1), 1, {"app.orders.events": {"0": 25, "1": 6}, "app.accounts.events": {"0": 9}}, finished=True)
    assert _behind_readers(tables, "ledger", 2)
    _batch(tables.checkpoint("ledger", 2), 1, {"app.orders.events": {"0": 30, "1": 6}}, finished=True)
    assert not _behind_readers(tables, "ledger", 2)
