"""PostgreSQL as a DatabaseHandler's store, through psycopg 3 (`pip install 'esk[postgres]'`).

    DatabaseHandler("ledger", reads=[orders], database=PostgreSQL("postgresql://app@db/shop"))

Handlers write with psycopg's placeholders (`%s`, `%(name)s`). One connection per
subscriber process, one transaction at a time on it, as with SQLite; the offset row's
compare-and-set holds across processes because PostgreSQL re-reads a row another
transaction changed before it updates it (READ COMMITTED): the second of two members
updating the same offset finds it no longer what it expected.

That update also holds the offset row until its transaction ends. A member frozen (a long
pause, a stopped process, a partition of the network) between its update and its commit
would hold its partition's new owner back for as long as it stays frozen; PostgreSQL ends
a session left idle inside a transaction for `idle_in_transaction_timeout_s`, and with it
the locks. The frozen member, when it goes on, finds its connection gone: the partition
starts again, on a new connection, from what the offset row says. The timeout is set in
each transaction (SET LOCAL), so it holds behind a pooler such as PgBouncer too. A handler
that awaits something slower than that between two statements loses its transaction the
same way: its event fails, and is tried again, then parked.

A connection whose peer went silent (a network that drops packets, a host that died) is
given up by TCP keepalives and a user timeout, which esk sets unless the DSN does.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .database import SAVEPOINT, Database, Params, Row, Transaction

if TYPE_CHECKING:
    import psycopg

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PostgreSQL:
    """A PostgreSQL database, by its connection string (libpq's: a URL or `key=value` pairs)."""

    dsn: str
    # As long as a subscriber's group waits for a silent member (session_timeout_ms): a
    # handler awaiting something slower than that inside its transaction loses it.
    idle_in_transaction_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if not 0 < self.idle_in_transaction_timeout_s < math.inf:
            raise ValueError(f"idle_in_transaction_timeout_s must be a positive number of seconds, not {self.idle_in_transaction_timeout_s}")

    def connect(self, default_path: Path) -> Database:
        return PostgresDatabase(self.dsn, self.idle_in_transaction_timeout_s)


async def _finish(statement: Any) -> Any:
    """Await a statement; if the caller is cancelled meanwhile, let it end anyway, so that
    the connection is in a known state when the error goes up."""
    running = asyncio.ensure_future(statement)
    try:
        return await asyncio.shield(running)
    except asyncio.CancelledError:
        await asyncio.wait([running])
        raise


def _params(params: Params) -> Params | None:
    # None, not an empty sequence: with no parameters psycopg leaves a `%` in the SQL alone.
    return params or None


class _PostgresSql:
    def __init__(self, connection: psycopg.AsyncConnection[Row]) -> None:
        self._connection = connection

    async def execute(self, sql: str, params: Params = ()) -> int:
        cursor = await self._connection.execute(sql, _params(params))
        return cursor.rowcount

    async def fetchone(self, sql: str, params: Params = ()) -> Row | None:
        cursor = await self._connection.execute(sql, _params(params))
        return await cursor.fetchone()

    async def fetchall(self, sql: str, params: Params = ()) -> list[Row]:
        cursor = await self._connection.execute(sql, _params(params))
        return await cursor.fetchall()


class _EskSql(_PostgresSql):
    """esk's own statements are written with `?` (and hold no other `?` nor `%`)."""

    async def execute(self, sql: str, params: Params = ()) -> int:
        return await super().execute(sql.replace("?", "%s"), params)

    async def fetchone(self, sql: str, params: Params = ()) -> Row | None:
        return await super().fetchone(sql.replace("?", "%s"), params)

    async def fetchall(self, sql: str, params: Params = ()) -> list[Row]:
        return await super().fetchall(sql.replace("?", "%s"), params)


# The advisory lock esk's schema changes take: a key of esk's own, unlikely to be one an
# application picked.
_SCHEMA_LOCK = int.from_bytes(b"esk-ddl", "big")


class _PostgresTransaction(Transaction):
    def __init__(self, database: PostgresDatabase, connection: psycopg.AsyncConnection[Row]) -> None:
        self._database = database
        self._connection = connection
        self.sql = _PostgresSql(connection)
        self.esk = _EskSql(connection)
        self._open = True

    @asynccontextmanager
    async def savepoint(self) -> AsyncIterator[None]:
        await self._connection.execute(f"SAVEPOINT {SAVEPOINT}")
        try:
            yield
            # Inside: a handler that caught a database error as its last statement leaves the
            # transaction aborted, and only this tells; its event is undone alone all the same.
            await self._connection.execute(f"RELEASE SAVEPOINT {SAVEPOINT}")
        except BaseException as failure:
            try:
                await self._connection.execute(f"ROLLBACK TO SAVEPOINT {SAVEPOINT}")
                await self._connection.execute(f"RELEASE SAVEPOINT {SAVEPOINT}")
            except Exception:
                if isinstance(failure, Exception):
                    raise  # the connection's error (it is gone, say) tells more than the handler's
                # a cancellation (a stop, a revoke) stays one, or its task would not end
            raise

    async def check_usable(self, idle_s: float) -> None:
        import psycopg

        status = self._connection.info.transaction_status
        if status == _IN_ERROR:
            raise psycopg.errors.InFailedSqlTransaction(
                "current transaction is aborted: a statement failed in it, and the handler went on"
            )
        if status != _IN_TRANSACTION:
            raise psycopg.OperationalError(f"the handler left its transaction {status.name}")
        # The client learns that the server ended an idle session only from a round trip: a
        # handler that waited after its last statement would leave it to the next event's.
        if idle_s * 1000 >= self._database.idle_in_transaction_timeout_ms / 2:
            await self._connection.execute("SELECT 1")

    async def lock_schema(self) -> None:
        await self._connection.execute("SELECT pg_advisory_xact_lock(%s)", (_SCHEMA_LOCK,))

    async def commit(self) -> None:
        try:
            await _finish(self._connection.execute("COMMIT"))
        finally:
            self._end()

    async def rollback(self) -> None:
        try:
            await self._connection.execute("ROLLBACK")
        finally:
            self._end()

    def _end(self) -> None:
        if self._open:
            self._open = False
            self._database.lock.release()


# psycopg.pq.TransactionStatus's IDLE, INTRANS and INERROR, without importing psycopg where it is not installed
_IDLE, _IN_TRANSACTION, _IN_ERROR = 0, 2, 3
# libpq's parameters: a silent peer is given up in about half a minute, idle or not.
_KEEPALIVES = {"keepalives": "1", "keepalives_idle": "10", "keepalives_interval": "5", "keepalives_count": "3", "tcp_user_timeout": "30000"}


async def _roll_back_if_begun(connection: psycopg.AsyncConnection[Row]) -> None:
    if not connection.closed and connection.info.transaction_status != _IDLE:
        await connection.execute("ROLLBACK")


# What PostgreSQL answers FATAL while it cannot take a connection for a while.
_PASSING_REFUSALS = ("too many clients", "starting up", "shutting down", "recovery mode", "not yet accepting connections")


class PostgresDatabase(Database):
    def __init__(self, dsn: str, idle_in_transaction_timeout_s: float = 10.0) -> None:
        self.dsn = dsn
        self.idle_in_transaction_timeout_ms = max(1, round(idle_in_transaction_timeout_s * 1000))
        self.lock = asyncio.Lock()
        self._connection: psycopg.AsyncConnection[Row] | None = None
        self._reconnecting = False  # a lost connection is being replaced

    def describe(self) -> str:
        from psycopg.conninfo import conninfo_to_dict

        info: dict[str, Any] = conninfo_to_dict(self.dsn)
        return f"postgresql://{info.get('host', 'localhost')}:{info.get('port', 5432)}/{info.get('dbname', '')}"

    def unreachable(self, error: BaseException) -> bool:
        import psycopg

        # psycopg's kind for a server that went away or never answered, as against a
        # statement's mistake (ProgrammingError) or a constraint (IntegrityError); but a
        # server that answered FATAL refused the DSN itself (its password, its role, its
        # database), which no wait mends, unless it is full, starting or stopping. (psycopg
        # gives no SQLSTATE for a failed connection: its text tells.)
        if not isinstance(error, psycopg.OperationalError):
            return False
        text = str(error)
        return "FATAL:" not in text or any(passing in text for passing in _PASSING_REFUSALS)

    async def open(self) -> None:
        if self._connection is None:
            self._connection = await self._connect()

    async def _connect(self) -> psycopg.AsyncConnection[Row]:
        try:
            import psycopg
            from psycopg.conninfo import conninfo_to_dict, make_conninfo
        except ImportError:
            raise ImportError("a PostgreSQL database needs psycopg: pip install 'esk[postgres]'") from None
        given = conninfo_to_dict(self.dsn)
        conninfo = make_conninfo(self.dsn, **{name: value for name, value in _KEEPALIVES.items() if name not in given})
        # autocommit: esk says BEGIN and COMMIT itself, as it does with SQLite.
        return await psycopg.AsyncConnection.connect(conninfo, autocommit=True)

    async def begin(self) -> Transaction:
        await self.lock.acquire()
        try:
            return _PostgresTransaction(self, await self._begun())
        except BaseException:
            self.lock.release()
            raise

    async def _begun(self) -> psycopg.AsyncConnection[Row]:
        """The connection, with a transaction begun on it. One found lost only now (the
        server restarted, or ended the session, since the last transaction) is replaced
        once: nothing had been done on it."""
        begin = f"BEGIN; SET LOCAL idle_in_transaction_session_timeout = {self.idle_in_transaction_timeout_ms}"
        replaced = False
        while True:
            connection = await self._connected()
            try:
                # A transaction left open (its ROLLBACK cut short: a stopped partition's task
                # cancelled once more as it rolled back) is not carried into this one: BEGIN
                # inside it would only warn, and this unit would commit what that one wrote.
                await _roll_back_if_begun(connection)
                await _finish(connection.execute(begin))
                return connection
            except Exception:
                if connection.closed and not replaced:
                    replaced = True
                    continue
                await _roll_back_if_begun(connection)
                raise
            except BaseException:  # cancelled, while BEGIN may have gone through
                await _roll_back_if_begun(connection)
                raise

    async def _connected(self) -> psycopg.AsyncConnection[Row]:
        """The open connection; one that was lost (the server ended the session, restarted,
        or the network failed) is replaced, as its transaction is gone anyway."""
        connection = self._connection
        if connection is None:
            raise RuntimeError(f"{self.describe()} is not open")
        if not connection.closed:
            return connection
        if not self._reconnecting:  # once an outage: each try after it fails as the first did
            log.warning("the connection to %s was lost; connecting again", self.describe())
            self._reconnecting = True
        # until this succeeds the lost connection stays: the next transaction tries again
        self._connection = connection = await self._connect()
        self._reconnecting = False
        log.info("connected to %s again", self.describe())
        return connection

    async def close(self) -> None:
        if self._connection is not None:
            await self._connection.close()
            self._connection = None
