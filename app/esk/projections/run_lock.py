"""One run at a time per read model generation.

Two runs of one generation would share its streaming checkpoint and its table: both would
plan the same batches, and a run starting over a generation readers do not use yet removes
its table and checkpoint (runner._table_fits, by Tables.start_over) from under the other.
So a run holds an exclusive lock on a file beside the generation's checkpoint for as long
as it runs. The lock is flock's: the kernel drops it when the process dies, however it
dies, so a crashed run never leaves a stale lock behind (on NFSv4, the server drops it once
the client's lease runs out). The file also says who holds it, for the refusal's message.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import Any, NamedTuple

POLL_S = 0.5  # how often a waiting run tries the lock again
# How long a run that does not wait still tries: `holder` takes the lock shared for an
# instant (`esk project list`), which must not refuse a run starting at that instant.
GRACE_S = 2 * POLL_S


class GenerationBusy(Exception):
    """Another run holds the generation."""

    def __init__(self, name: str, generation: int, holder: str) -> None:
        super().__init__(
            f"generation {generation} is kept by another run ({holder}), and one run keeps a generation at a time: "
            f"leave {name} to that run, or stop it first"
        )
        self.name = name
        self.generation = generation
        self.holder = holder


class GenerationLock:
    """The lock of `name`'s `generation`, at `path`: `acquire` it, then use it as a context
    manager, which releases it."""

    def __init__(self, path: Path, name: str, generation: int) -> None:
        self.path = path
        self.name = name
        self.generation = generation
        self._fd: int | None = None
        self._me: dict[str, object] = {}

    def acquire(self, wait_s: float = 0.0, asked_to_stop: threading.Event | None = None) -> bool:
        """Takes the lock, trying for `wait_s` at most; raises GenerationBusy if another
        run holds it then. False (and not held) when `asked_to_stop` is set first."""
        if self._fd is not None:
            return True
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            if not self._locked(fd, wait_s, asked_to_stop):
                os.close(fd)
                return False
            self._me = _me()
            _write(fd, self._me)
        except BaseException:
            os.close(fd)  # and the lock with it, if it was taken
            raise
        self._fd = fd
        return True

    def held_up(self, why: str | None) -> None:
        """Says in the file, for readers, that the run holding it is held up (`why`) until
        someone acts, a release say, or no longer is (None): waiting on it helps nothing."""
        self._say("held_up", why)

    def takes_offers(self) -> None:
        """Says in the file that the run holding it keeps it up until stopped and takes over
        a generation a rebuild offers it (runner._hand_over); a run that ends by itself does
        not, and a rebuild beside it waits for its end instead."""
        self._say("takes_offers", True)

    def _say(self, key: str, value: object) -> None:
        """`key` set to `value` in the file (None: taken out), while it is held."""
        if self._fd is None:
            return
        self._me = {k: v for k, v in self._me.items() if k != key} | ({key: value} if value is not None else {})
        _write(self._fd, self._me)

    def _locked(self, fd: int, wait_s: float, asked_to_stop: threading.Event | None) -> bool:
        deadline = time.monotonic() + wait_s
        stopped = asked_to_stop or threading.Event()  # none: a wait that only the deadline ends
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise GenerationBusy(self.name, self.generation, self._holder()) from None
            except OSError as error:  # ENOLCK: an NFS mount without its lock service
                raise OSError(
                    error.errno, f"cannot lock {self.path} ({error.strerror}): the warehouse must be on a file system with file locks"
                ) from error
            if stopped.wait(POLL_S):
                return False

    def holder(self) -> str | None:
        """Who keeps the generation now (as `GenerationBusy` names them), or None when no
        run does. A file left by a run that has ended names it still: only the lock tells."""
        keeper = self.keeper()
        return None if keeper is None else keeper.who

    def keeper(self) -> Keeper | None:
        """The run keeping the generation now, or None when no run does."""
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            written = self._written()
            return Keeper(self._holder(), written.get("held_up"), written.get("takes_offers") is True)
        finally:
            os.close(fd)  # and the shared lock with it
        return None

    def release(self) -> None:
        if self._fd is not None:
            if "held_up" in self._me:  # the next holder's run is not held up, before it writes its own
                self.held_up(None)
            os.close(self._fd)  # closing the only descriptor of the file drops its flock
            self._fd = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def __enter__(self) -> GenerationLock:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None) -> None:
        self.release()

    def _holder(self) -> str:
        """Who holds the lock, as the holder wrote it (it may not have written it yet)."""
        holder = self._written()
        try:
            return f"pid {holder['pid']} on {holder['host']} since {holder['since']}: {holder['command']}"
        except KeyError:
            return "its details not written yet"

    def _written(self) -> dict[str, Any]:
        try:
            written = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return written if isinstance(written, dict) else {}


class Keeper(NamedTuple):
    """The run holding a generation's lock: who (`GenerationBusy`'s words), why it is held
    up, if it is, and whether it takes over a generation a rebuild offers it."""

    who: str
    held_up: str | None
    takes_offers: bool


def _write(fd: int, holder: dict[str, object]) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(holder).encode(), 0)


def _me() -> dict[str, object]:
    program = Path(sys.argv[0]) if sys.argv and sys.argv[0] else Path("python")
    # `python -m esk ...` runs esk/__main__.py: the package is what a reader knows it by
    command = " ".join([program.parent.name if program.name == "__main__.py" else program.name, *sys.argv[1:]])
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "since": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": command[:200],
    }
