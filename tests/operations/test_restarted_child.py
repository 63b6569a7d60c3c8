"""`esk dev` starts the read models' driver again when it exits, later after each exit in a
row, and from the first delay again after a run that went well (no Kafka: a real child
process that exits at once stands for the driver)."""

from __future__ import annotations

import itertools
import logging
import os
import sys
import time

import pytest

from esk import runtime
from esk.runtime import RestartedChild

EXITS_AT_ONCE = [sys.executable, "-c", "raise SystemExit(3)"]


def _starts(child: RestartedChild, count: int, timeout_s: float = 30.0) -> list[float]:
    """When `child` was started, its first `count` starts."""
    starts: list[float] = []
    deadline = time.monotonic() + timeout_s
    while len(starts) < count:
        assert time.monotonic() < deadline, f"started {len(starts)} times, not {count}"
        running = child.process
        child.watch()
        if child.process is not None and child.process is not running:
            starts.append(time.monotonic())
        time.sleep(0.005)
    return starts


def _reap(child: RestartedChild) -> None:
    if child.process is not None:
        child.process.wait()


def _gaps(starts: list[float]) -> list[float]:
    return [later - earlier for earlier, later in itertools.pairwise(starts)]


def test_a_child_that_keeps_exiting_is_started_again_each_time_later(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(runtime, "DRIVER_RESTART_DELAYS_S", (0.2, 0.6, 1.2))
    child = RestartedChild(EXITS_AT_ONCE, dict(os.environ), "the driver")
    with caplog.at_level(logging.ERROR, logger=runtime.log.name):
        gaps = _gaps(_starts(child, 5))
    # each wait is the delay at least (plus the child's own run), the last one repeated
    for gap, delay in zip(gaps, (0.2, 0.6, 1.2, 1.2), strict=True):
        assert delay <= gap < delay + 2.0, gaps
    assert caplog.text.count("the driver exited (3); starting it again in") == 4
    _reap(child)


def test_a_child_that_ran_well_before_it_exited_starts_from_the_first_delay(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runtime, "DRIVER_RESTART_DELAYS_S", (0.2, 5.0))
    monkeypatch.setattr(runtime, "DRIVER_RAN_WELL_S", 0.0)  # every run counts as one that went well
    child = RestartedChild(EXITS_AT_ONCE, dict(os.environ), "the driver")
    gaps = _gaps(_starts(child, 4))
    assert all(0.2 <= gap < 2.2 for gap in gaps), gaps
    _reap(child)
