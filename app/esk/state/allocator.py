"""glibc's allocator, set up for a process whose RocksDB stores live within a budget.

RocksDB and the Kafka clients free large blocks all the time: a flushed memtable's arena,
compaction buffers, fetch responses. glibc keeps freed heap memory for reuse and gives it
back to the system only from the top of the heap, so resident memory drifts above what
is in use and stays there. Blocks of 4 MiB and more are mapped on their own instead,
and unmapped the moment they are freed; the heap is trimmed when 4 MiB are free at its
top. The thresholds, and why not lower ones (every produce request would be mapped afresh),
are measured in docs/benchmarks.md (probes).
"""

from __future__ import annotations

import ctypes
import logging
import os

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
LARGE_BLOCK = 4 * 1024 * 1024
_ENVIRONMENT = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


def return_large_blocks(threshold: int = LARGE_BLOCK) -> bool:
    """Map blocks of `threshold` bytes and more on their own, and trim the heap's top
    beyond it. Leaves glibc as it is when the environment already sets either threshold
    (the operator's choice wins), and does nothing where the C library is not glibc.
    Returns whether it changed anything. Call it before the stores open."""
    if any(name in os.environ for name in _ENVIRONMENT):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    changed = bool(mallopt(_M_MMAP_THRESHOLD, threshold)) and bool(mallopt(_M_TRIM_THRESHOLD, threshold))
    if not changed:
        log.warning("glibc refused the allocator thresholds; resident memory may drift above the budget")
    return changed
