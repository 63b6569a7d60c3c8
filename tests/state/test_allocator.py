"""The allocator thresholds that let freed RocksDB and client buffers go back to the system."""

from __future__ import annotations

import platform

import pytest

from esk.state.allocator import return_large_blocks

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")


@glibc
def test_sets_the_thresholds_on_glibc(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_", raising=False)
    assert return_large_blocks() is True


@pytest.mark.parametrize("variable", ["MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"])
def test_the_operators_environment_wins(monkeypatch: pytest.MonkeyPatch, variable: str) -> None:
    monkeypatch.setenv(variable, "131072")
    assert return_large_blocks() is False
