"""Where a DatabaseHandler's rows live, together with its offsets and its parked events.

Exactly once rests on one rule: a handler's writes, the subscription's next offset and
anything parked are one database transaction. The offset row is a compare-and-set: a batch
commits only if the row still holds the offset this member read when it took the
partition, so a member that lost the partition (a rebalance, a pause, a reset) commits
nothing.

`Database` is what a store implements (SQLite here, the embedded default); the SQL esk
runs against it is written once, with `?` placeholders, in `OffsetTables`.
"""

from __future__ import annotations

import asyncio
import sqlite3
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol, TypeVar

T = TypeVar("T")

Params = Sequence[Any] | Mapping[str, Any]
Row = tuple[Any, ...]


class Sql(Protocol):
    """A handler's way into its database, inside the transaction esk opened for it. The SQL
    is the database's own (SQLite: `?` or `:name` placeholders; PostgreSQL, psycopg's `%s` or
    `%(name)s`)."""

    async def execute(self, sql: str, params: Params = ()) -> int:
        """Run a statement; return the number of rows it changed."""
        ...

    async def fetchone(self, sql: str, params: Params = ()) -> Row | None: ...

    async def fetchall(self, sql: str, params: Params = ()) -> list[Row]: ...


# Every savepoint esk takes has this one name: SQLite and PostgreSQL roll back to and release
# the newest of a name, so nested ones still hold. A statement of a new text each event
# would be compiled each time, and in SQLite push the handlers' own statements out of the
# connection's statement cache.
SAVEPOINT = "esk_event"


class Transaction(ABC):
    """One open transaction of a Database: `sql` speaks the database's own placeholders (what
    handlers get), `esk` takes esk's own statements, written with `?`."""

    sql: Sql
    esk: Sql

    @abstractmethod
    def savepoint(self) -> Any:
        """An async context manager: what runs inside it is undone alone if it raises."""

    @abstractmethod
    async def check_usable(self, idle_s: float) -> None:
        """Raises when the transaction takes no more statements: one failed in it, which
        PostgreSQL aborts it for (a handler that caught the error does not know), or a
        statement ended it, or the server ended a session idle for as long as `idle_s` (a
        handler's time) may have let it be. Asks the server only for the last."""

    @abstractmethod
    async def lock_schema(self) -> None:
        """Until this transaction ends, no other that asked the same changes the schema: two
        members starting together both run `CREATE TABLE IF NOT EXISTS`, which PostgreSQL
        does not serialize."""

    @abstractmethod
    async def commit(self) -> None: ...

    @abstractmethod
    async def rollback(self) -> None: ...


class Database(ABC):
    """A store for DatabaseHandlers. `open` before use; `begin` one transaction at a time
    per connection (an implementation serializes them as it must)."""

    @abstractmethod
    async def open(self) -> None: ...

    @abstractmethod
    async def begin(self) -> Transaction: ...

    @abstractmethod
    async def close(self) -> None: ...

    @abstractmethod
    def describe(self) -> str:
        """Where it is, for humans (a path, a host)."""

    def unreachable(self, error: BaseException) -> bool:
        """Whether `error` says the database does not answer now (a server down, a network
        away), which waiting may mend, rather than that something was wrong."""
        return False

    def missing(self) -> bool:
        """Whether opening it would make it: nothing a subscriber wrote is there."""
        return False

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[Transaction]:
        """Commit on success, roll back on any error."""
        tx = await self.begin()
        try:
            yield tx
        except BaseException:
            await tx.rollback()
            raise
        await tx.commit()


class DatabaseConfig(Protocol):
    """What a DatabaseHandler declares (`SQLite(...)`): how to reach its database."""

    def connect(self, default_path: Path) -> Database:
        """The database; `default_path` is where an embedded one lives unless told otherwise."""
        ...


async def finish_in_thread(function: Any, *args: Any) -> Any:
    """Run a blocking call in a thread; if the caller is cancelled meanwhile, wait until the
    call is over anyway, so that the connection is in a known state when the error goes up."""
    call = asyncio.ensure_future(asyncio.to_thread(function, *args))
    try:
        return await asyncio.shield(call)
    except asyncio.CancelledError:
        await asyncio.wait([call])
        raise


# -- SQLite ---------------------------------------------------------------------------


@dataclass(frozen=True)
class SQLite:
    """A SQLite file (relative paths are relative to the directory esk runs in); None: the
    subscriber's data directory, `<data_dir>/<subscription>.sqlite`."""

    path: str | Path | None = None

    def connect(self, default_path: Path) -> Database:
        return SQLiteDatabase(Path(self.path) if self.path is not None else default_path)


class _SQLiteSql:
    # Statements run on the event loop's thread: against a local file they take
    # microseconds, less than handing each one to a thread would. Only what may wait (the
    # write lock, the commit's sync) goes to a thread.
    def __init__(self, connection: sqlite3.Connection) -> None:
        self._connection = connection

    async def execute(self, sql: str, params: Params = ()) -> int:
        return self._connection.execute(sql, params).rowcount

    async def fetchone(self, sql: str, params: Params = ()) -> Row | None:
        row: Row | None = self._connection.execute(sql, params).fetchone()
        return row

    async def fetchall(self, sql: str, params: Params = ()) -> list[Row]:
        return self._connection.execute(sql, params).fetchall()


class _SQLiteTransaction(Transaction):
    def __init__(self, database: SQLiteDatabase, connection: sqlite3.Connection) -> None:
        self._database = database
        self._connection = connection
        self.sql = self.esk = _SQLiteSql(connection)
        self._open = True

    def savepoint(self) -> _SQLiteSavepoint:
        return _SQLiteSavepoint(self._connection)

    async def check_usable(self, idle_s: float) -> None:
        if not self._connection.in_transaction:
            raise sqlite3.OperationalError("the transaction was ended by a statement of the handler")

    async def lock_schema(self) -> None:
        """Held already: BEGIN IMMEDIATE took the file's write lock."""

    async def commit(self) -> None:
        try:
            await finish_in_thread(self._connection.execute, "COMMIT")
        finally:
            self._end()

    async def rollback(self) -> None:
        try:
            if self._connection.in_transaction:
                self._connection.execute("ROLLBACK")
        finally:
            self._end()

    def _end(self) -> None:
        if self._open:
            self._open = False
            self._database.lock.release()


class _SQLiteSavepoint:
    # A class, not a generator: one is taken for every event a handler writes.
    __slots__ = ("_connection",)

    def __init__(self, connection: sqlite3.Connection) -> None:
        self._connection = connection

    async def __aenter__(self) -> None:
        self._connection.execute(f"SAVEPOINT {SAVEPOINT}")

    async def __aexit__(self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None) -> None:
        if kind is not None:
            self._connection.execute(f"ROLLBACK TO {SAVEPOINT}")
        self._connection.execute(f"RELEASE {SAVEPOINT}")


class SQLiteDatabase(Database):
    """One connection per process, one transaction at a time (SQLite has one writer anyway).
    Other processes on the same file wait for the write lock (busy timeout)."""

    BUSY_TIMEOUT_MS = 30_000

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lock = asyncio.Lock()
        self._connection: sqlite3.Connection | None = None

    def describe(self) -> str:
        return str(self.path)

    def missing(self) -> bool:
        return not self.path.exists()

    async def open(self) -> None:
        if self._connection is not None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # isolation_level=None: esk says BEGIN and COMMIT itself (savepoints need that).
        connection = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        connection.execute(f"PRAGMA busy_timeout = {self.BUSY_TIMEOUT_MS}")
        # WAL: readers (esk subscriptions status) never block the subscriber. NORMAL sync
        # survives a crash of the process; a power loss may lose the last transactions, and
        # with them their offsets, so they are handled again: still exactly once.
        connection.execute("PRAGMA journal_mode = WAL")
        connection.execute("PRAGMA synchronous = NORMAL")
        self._connection = connection

    async def begin(self) -> Transaction:
        connection = self._connection
        if connection is None:
            raise RuntimeError(f"{self.path} is not open")
        await self.lock.acquire()
        try:
            # IMMEDIATE takes the write lock now, so a busy file is waited for here (in a
            # thread), not in the middle of a handler's statements.
            await finish_in_thread(connection.execute, "BEGIN IMMEDIATE")
        except BaseException:
            if connection.in_transaction:  # begun after all, while the caller was cancelled
                connection.execute("ROLLBACK")
            self.lock.release()
            raise
        return _SQLiteTransaction(self, connection)

    async def close(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None

