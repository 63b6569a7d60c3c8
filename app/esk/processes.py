"""Other processes, as the machine sees them."""

from __future__ import annotations

import os


def alive(pid: int) -> bool:
    """Whether process `pid` runs (one of another user's counts; a zombie does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child (exited, not yet reaped) is not alive.
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ", 1)[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return True
