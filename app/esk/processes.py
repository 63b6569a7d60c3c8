"""Other processes, as the machine sees them."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import subprocess
import threading
from pathlib import Path
from typing import IO

import psutil

log = logging.getLogger(__name__)


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


def set_from_signal_handler(event: threading.Event) -> None:
    """Sets `event` from a signal handler. The handler runs in the main thread between two
    bytecodes, perhaps inside that thread's own `event.wait()`, which holds the event's lock
    for a moment: `set()` there would wait for itself for ever. A thread of its own sets it
    as soon as the wait lets go."""
    threading.Thread(target=event.set, name="signal", daemon=True).start()


def kill_tree(process: subprocess.Popen[bytes]) -> None:
    """Kills `process` and every process below it: killed alone, a parent that supervises
    others (esk dev's) would leave them running, holding their ports and stores."""
    try:
        below = psutil.Process(process.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        below = []
    for each in below:
        with contextlib.suppress(psutil.NoSuchProcess):
            each.kill()
    process.kill()
    process.wait()


class HeldElsewhere(Exception):
    """Another process holds the lock; `pid` is the one it wrote, when it could be read."""

    def __init__(self, pid: int | None) -> None:
        super().__init__(f"held by process {pid}")
        self.pid = pid

    @property
    def holder(self) -> str:
        """ " (pid N)" when the holder is known, for a sentence about it."""
        return f" (pid {self.pid})" if self.pid is not None else ""


# What a filesystem without flock answers (NFS without lockd, some FUSE mounts).
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS)


def hold_lock(path: Path) -> IO[str] | None:
    """An exclusive lock on `path` (made if missing) that holds while the file returned is
    open, or a copy of it in a child process (`pass_fds`), so at most as long as they live
    (the kernel drops it then, however they end); the file tells this process's pid.
    Raises HeldElsewhere; None, with a warning, on a filesystem that has no locks."""
    path.parent.mkdir(parents=True, exist_ok=True)
    file = path.open("a+")
    try:
        fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        file.seek(0)
        pid = file.read().strip()
        file.close()
        raise HeldElsewhere(int(pid) if pid.isdigit() else None) from None
    except OSError as error:
        file.close()
        if error.errno not in _NO_LOCKS:
            raise
        log.warning("no lock on %s (%s): nothing keeps a second process from using it too", path, error.strerror)
        return None
    file.truncate(0)
    file.write(f"{os.getpid()}\n")
    file.flush()
    return file
