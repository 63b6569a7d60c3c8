"""esk dev's and a processor's locks: one holder at a time, named to the next, and let go
when it ends, however it ends."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from esk.processes import HeldElsewhere, hold_lock
from esk.processing.processor import PROCESSOR_LOCK, Processor
from esk.registry import load_registry
from esk.settings import Settings


def test_a_held_lock_names_its_holder_and_is_free_once_it_is_gone(tmp_path: Path) -> None:
    path = tmp_path / "state" / "esk-dev.lock"
    holder = subprocess.Popen(
        [sys.executable, "-c", f"import time; from pathlib import Path; from esk.processes import hold_lock; f = hold_lock(Path({str(path)!r})); print('held', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        with pytest.raises(HeldElsewhere) as refused:
            hold_lock(path)
        assert refused.value.pid == holder.pid
    finally:
        holder.kill()  # no chance to let go itself: the kernel does
        holder.wait()
    held = hold_lock(path)
    assert path.read_text() == f"{os.getpid()}\n"
    held.close()


async def test_a_second_processor_over_a_state_directory_is_refused(tmp_path: Path) -> None:
    settings = Settings(processor={"state_dir": tmp_path / "state"}, _env_file=None)
    first = hold_lock(tmp_path / "state" / PROCESSOR_LOCK)  # as a running processor holds it
    try:
        with pytest.raises(HeldElsewhere) as refused:
            await Processor(settings, load_registry(settings.domain)).run(asyncio.Event())  # before it reaches Kafka
        assert refused.value.pid == os.getpid()
    finally:
        assert first is not None
        first.close()
