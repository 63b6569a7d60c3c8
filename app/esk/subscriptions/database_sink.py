"""A DatabaseHandler's sink: its handlers' writes, its offsets (`esk_offsets`) and its parked
events (`esk_parked`) in one transaction of its own database.

The offset row is a compare-and-set: a unit commits only if the row still holds the offset
this member last read or wrote. A stale member (it lost the partition, or a reset rewound
it) finds the row changed, rolls everything back and starts the partition again from what
the row says. A failing event is undone alone (DatabaseUnit).
"""

from __future__ import annotations

import time

import msgspec
from aiokafka import TopicPartition

from ..domain.aggregate import one_line
from ..protocol import now_ms
from .api import DatabaseHandler
from .database import Database, Row, Sql, Transaction
from .parking import ParkedEvent, ParkStatus, Resolution, decoded, park_status
from .routing import Delivery, call_handler
from .sinks import Fenced, PartitionSink, StartingPoint, Unit, UnitLost

# Portable SQL (SQLite and PostgreSQL alike), with `?` placeholders.
ESK_TABLES = (
    """CREATE TABLE IF NOT EXISTS esk_offsets (
        subscription TEXT NOT NULL,
        topic TEXT NOT NULL,
        kafka_partition INTEGER NOT NULL,
        next_offset BIGINT NOT NULL,
        replay_until BIGINT NOT NULL DEFAULT 0,
        PRIMARY KEY (subscription, topic, kafka_partition))""",
    """CREATE TABLE IF NOT EXISTS esk_parked (
        subscription TEXT NOT NULL,
        topic TEXT NOT NULL,
        kafka_partition INTEGER NOT NULL,
        kafka_offset BIGINT NOT NULL,
        aggregate_id TEXT NOT NULL,
        event_type TEXT,
        status TEXT NOT NULL,
        reason TEXT NOT NULL,
        attempts INTEGER NOT NULL,
        parked_at BIGINT NOT NULL,
        resolved_by TEXT,
        resolved_at BIGINT,
        record_key BYTEA,
        record_value BYTEA,
        record_headers TEXT NOT NULL,
        earlier TEXT NOT NULL DEFAULT '[]',
        PRIMARY KEY (subscription, topic, kafka_partition, kafka_offset))""",
    # An aggregate's parked events: looked up as each of its events arrives, and resolved
    # ones are kept (the record of who retried or skipped them).
    "CREATE INDEX IF NOT EXISTS esk_parked_aggregate ON esk_parked (subscription, topic, kafka_partition, aggregate_id)",
)
_PARKED_COLUMNS = (
    "subscription, topic, kafka_partition, kafka_offset, aggregate_id, event_type, status, reason, attempts, "
    "parked_at, resolved_by, resolved_at, record_key, record_value, record_headers, earlier"
)
# Added after esk_parked was first released: a table made before it gets it at `prepare`.
_ADDED_COLUMNS = ("earlier TEXT NOT NULL DEFAULT '[]'",)
# One aggregate's parked events in one partition (DatabaseUnit._parked gives the values).
_AGGREGATE_PARKED = "subscription = ? AND topic = ? AND kafka_partition = ? AND aggregate_id = ? AND status = ?"
_JSON = msgspec.json.Encoder()
_HEADERS_DECODER = msgspec.json.Decoder(list[tuple[str, bytes]])
_EARLIER_DECODER = msgspec.json.Decoder(tuple[Resolution, ...])


async def prepare(database: Database, subscription: DatabaseHandler) -> None:
    """esk's tables and the subscription's own schema, in one transaction."""
    await database.open()
    async with database.transaction() as tx:
        await tx.lock_schema()
        for statement in ESK_TABLES:
            await tx.esk.execute(statement)
        for column in _ADDED_COLUMNS:
            await _add_column(tx, "esk_parked", column)
        for statement in subscription.schema:
            await tx.sql.execute(statement)


async def _add_column(tx: Transaction, table: str, column: str) -> None:
    """`column` (its definition) added to `table` unless it is there: asked by selecting it,
    as SQLite and PostgreSQL both answer, in a savepoint, since PostgreSQL's transaction
    would not survive the error."""
    name = column.split()[0]
    try:
        async with tx.savepoint():
            await tx.esk.fetchall(f"SELECT {name} FROM {table} WHERE 1 = 0")
    except Exception:
        await tx.esk.execute(f"ALTER TABLE {table} ADD COLUMN {column}")


async def save_parked(sql: Sql, event: ParkedEvent) -> None:
    await sql.execute(
        f"INSERT INTO esk_parked ({_PARKED_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
        "ON CONFLICT (subscription, topic, kafka_partition, kafka_offset) DO UPDATE SET status = excluded.status, "
        "reason = excluded.reason, attempts = excluded.attempts, parked_at = excluded.parked_at, "
        "resolved_by = excluded.resolved_by, resolved_at = excluded.resolved_at, earlier = excluded.earlier",
        (
            event.subscription, event.topic, event.partition, event.offset, event.aggregate_id, event.event_type,
            event.status.value, event.reason, event.attempts, event.parked_at, event.resolved_by, event.resolved_at,
            event.key, event.value, _JSON.encode(event.headers).decode(), _JSON.encode(event.earlier).decode(),
        ),
    )


async def load_parked(sql: Sql, subscription: str, status: ParkStatus | None = ParkStatus.PARKED) -> list[ParkedEvent]:
    where = "subscription = ?" + (" AND status = ?" if status is not None else "")
    params: tuple[str, ...] = (subscription, status.value) if status is not None else (subscription,)
    rows = await sql.fetchall(
        f"SELECT {_PARKED_COLUMNS} FROM esk_parked WHERE {where} ORDER BY topic, kafka_partition, kafka_offset", params
    )
    return [_parked_event(row) for row in rows]


def _parked_event(row: Row) -> ParkedEvent:
    (subscription, topic, partition, offset, aggregate_id, event_type, status, reason, attempts, parked_at,
     resolved_by, resolved_at, key, value, headers, earlier) = row
    return ParkedEvent(
        subscription, topic, partition, offset, aggregate_id, event_type, reason, attempts,
        None if key is None else bytes(key), None if value is None else bytes(value), _HEADERS_DECODER.decode(headers),
        parked_at, park_status(status), resolved_by, resolved_at, decoded(_EARLIER_DECODER, earlier),
    )


async def read_offsets(sql: Sql, subscription: str) -> dict[TopicPartition, tuple[int, int]]:
    """(next offset, replay until) of each partition the subscription has committed."""
    rows = await sql.fetchall(
        "SELECT topic, kafka_partition, next_offset, replay_until FROM esk_offsets WHERE subscription = ?", (subscription,)
    )
    return {TopicPartition(topic, partition): (next_offset, replay_until) for topic, partition, next_offset, replay_until in rows}


async def rewind(sql: Sql, subscription: str, offsets: dict[TopicPartition, int], by: str) -> None:
    """Set each partition's next offset, remembering how far it had been (what is handled
    again below that is a replay); events parked at or after the new offset are marked reset
    (by `by`), since the replay meets them again: kept, with the record of how each was
    resolved before, for the replay's parking of them."""
    current = await read_offsets(sql, subscription)
    for tp, offset in offsets.items():
        before, replay_until = current.get(tp, (0, 0))
        await sql.execute(
            "INSERT INTO esk_offsets (subscription, topic, kafka_partition, next_offset, replay_until) VALUES (?, ?, ?, ?, ?) "
            "ON CONFLICT (subscription, topic, kafka_partition) DO UPDATE SET next_offset = excluded.next_offset, "
            "replay_until = excluded.replay_until",
            (subscription, tp.topic, tp.partition, offset, max(before, replay_until)),
        )
        await sql.execute(
            "UPDATE esk_parked SET status = ?, resolved_by = ?, resolved_at = ? WHERE subscription = ? AND topic = ? "
            "AND kafka_partition = ? AND kafka_offset >= ? AND status = ?",
            (ParkStatus.RESET.value, by, now_ms(), subscription, tp.topic, tp.partition, offset, ParkStatus.PARKED.value),
        )


class DatabaseSink(PartitionSink):
    def __init__(self, database: Database, subscription: DatabaseHandler, tp: TopicPartition) -> None:
        self.database = database
        self.subscription = subscription
        self.tp = tp
        self.expected: int | None = None  # what the offset row holds, as this member last saw it

    async def open(self) -> StartingPoint:
        async with self.database.transaction() as tx:
            row = await tx.esk.fetchone(
                "SELECT next_offset, replay_until FROM esk_offsets WHERE subscription = ? AND topic = ? AND kafka_partition = ?",
                self._where(),
            )
            parked = await tx.esk.fetchall(
                "SELECT aggregate_id, kafka_offset, reason FROM esk_parked WHERE subscription = ? AND topic = ? "
                "AND kafka_partition = ? AND status = ?",
                (*self._where(), ParkStatus.PARKED.value),
            )
        self.expected = None if row is None else int(row[0])
        entries = ((str(aggregate_id), int(offset), str(reason)) for aggregate_id, offset, reason in parked)
        return StartingPoint.of(self.expected, 0 if row is None else int(row[1]), entries)

    async def begin(self) -> Unit:
        return DatabaseUnit(self, await self.database.begin())

    async def verify(self) -> None:
        async with self.database.transaction() as tx:
            row = await tx.esk.fetchone(
                "SELECT next_offset FROM esk_offsets WHERE subscription = ? AND topic = ? AND kafka_partition = ?", self._where()
            )
        if (None if row is None else int(row[0])) != self.expected:
            raise Fenced(f"{self.subscription.name}: the offset of {self.tp.topic}/{self.tp.partition} moved under this member")

    async def close(self) -> None:
        """The database is the subscription's, shared by its partitions: the runner closes it."""

    def _where(self) -> tuple[str, str, int]:
        return self.subscription.name, self.tp.topic, self.tp.partition

    async def move_offset(self, sql: Sql, next_offset: int) -> bool:
        """The compare-and-set: True when the row held what this member expected."""
        if self.expected is None:
            changed = await sql.execute(
                "INSERT INTO esk_offsets (subscription, topic, kafka_partition, next_offset) VALUES (?, ?, ?, ?) "
                "ON CONFLICT (subscription, topic, kafka_partition) DO NOTHING",
                (*self._where(), next_offset),
            )
        else:
            changed = await sql.execute(
                "UPDATE esk_offsets SET next_offset = ? WHERE subscription = ? AND topic = ? AND kafka_partition = ? "
                "AND next_offset = ?",
                (next_offset, *self._where(), self.expected),
            )
        return changed == 1


# Where an event that fails with no savepoint of its own undoes its unit back to: the unit's
# first write, then again every UNDO_WINDOW writes (DatabaseUnit._mark).
UNIT_SAVEPOINT = "esk_unit"
# Each write since the mark is kept, to be written again after an undo, and a unit's
# thousands kept alive cost the garbage collector more than savepoints save with SQLite.
UNDO_WINDOW = 256
_Written = tuple[Delivery, bool] | ParkedEvent  # an event applied (and whether as a replay), or a parked one


class DatabaseUnit(Unit):
    """A unit's events run without a savepoint each until one fails: a savepoint costs two
    statements an event, round trips to PostgreSQL (docs/benchmarks.md, W6). The first to
    fail undoes the unit back to its latest mark and applies what it wrote since again,
    each event in a savepoint, as every later one in the unit then runs: the failing event
    is undone alone, as if each had had one. A handler's effects are its transaction's
    writes, so one applied again over the same rows writes the same."""

    def __init__(self, sink: DatabaseSink, transaction: Transaction) -> None:
        self.sink = sink
        self.transaction = transaction
        self._over = False
        self._written: list[_Written] | None = []  # None: each event in a savepoint of its own from here
        self._lost: Exception | None = None  # what kept `_undo` from writing again what it undid
        self._marked = False

    async def apply(self, delivery: Delivery, replaying: bool) -> None:
        if self._written is None:
            await self._apply_alone(delivery, replaying)
            return
        await self._mark()
        try:
            started = time.monotonic()
            await self._handle(delivery, replaying)
            await self.transaction.check_usable(time.monotonic() - started)
        except Exception:
            await self._undo()
            raise
        self._written.append((delivery, replaying))

    async def _handle(self, delivery: Delivery, replaying: bool) -> None:
        await call_handler(delivery, self.sink.subscription.name, replaying, db=self.transaction.sql)

    async def _apply_alone(self, delivery: Delivery, replaying: bool) -> None:
        async with self.transaction.savepoint():
            await self._handle(delivery, replaying)

    async def _mark(self) -> None:
        """Before a write: where an undo goes back to, taken at the unit's first write and
        again once UNDO_WINDOW writes are kept (those before it stay written)."""
        assert self._written is not None
        if self._marked and len(self._written) < UNDO_WINDOW:
            return
        if self._marked:
            await self.transaction.esk.execute(f"RELEASE SAVEPOINT {UNIT_SAVEPOINT}")
        await self.transaction.esk.execute(f"SAVEPOINT {UNIT_SAVEPOINT}")
        self._marked = True
        self._written.clear()

    async def _undo(self) -> None:
        written, self._written = self._written or [], None
        try:
            await self.transaction.esk.execute(f"ROLLBACK TO SAVEPOINT {UNIT_SAVEPOINT}")
            for item in written:
                if isinstance(item, ParkedEvent):
                    await save_parked(self.transaction.esk, item)
                else:
                    await self._apply_alone(*item)
        except Exception as error:  # the transaction is gone, or a handler failed this time: the unit cannot commit
            self._lost = error

    async def park(self, event: ParkedEvent) -> None:
        if self._written is not None:
            await self._mark()
            self._written.append(event)
        await save_parked(self.transaction.esk, event)

    async def parked_of(self, aggregate_id: str) -> list[ParkedEvent]:
        rows = await self.transaction.esk.fetchall(
            f"SELECT {_PARKED_COLUMNS} FROM esk_parked WHERE {_AGGREGATE_PARKED} ORDER BY kafka_offset", self._parked(aggregate_id)
        )
        return [_parked_event(row) for row in rows]

    async def entry_at(self, offset: int) -> ParkedEvent | None:
        row = await self.transaction.esk.fetchone(
            f"SELECT {_PARKED_COLUMNS} FROM esk_parked WHERE subscription = ? AND topic = ? AND kafka_partition = ? "
            "AND kafka_offset = ?",
            (*self.sink._where(), offset),
        )
        return None if row is None else _parked_event(row)

    async def parked_to_resolve(self, aggregate_id: str) -> list[ParkedEvent]:
        """A retry from the command line and a subscriber opening the partition run side by
        side (PostgreSQL: at read committed): the update locks the first parked event, so
        the one that comes second waits, then reads what the first left. When the first
        left some parked, the row the second waited for is no longer the first, and the
        update locked nothing: it locks the new first one. SQLite's BEGIN IMMEDIATE
        serializes them already."""
        params = self._parked(aggregate_id)
        while True:
            locked = await self.transaction.esk.execute(
                f"UPDATE esk_parked SET status = status WHERE {_AGGREGATE_PARKED} AND kafka_offset = "
                f"(SELECT MIN(kafka_offset) FROM esk_parked WHERE {_AGGREGATE_PARKED})",
                params + params,
            )
            parked = await self.parked_of(aggregate_id)
            if locked or not parked:
                return parked

    def _parked(self, aggregate_id: str) -> tuple[str, str, int, str, str]:
        return (*self.sink._where(), aggregate_id, ParkStatus.PARKED.value)

    async def commit(self, next_offset: int | None) -> None:
        self._over = True
        if self._lost is not None:
            await self.transaction.rollback()
            raise UnitLost(f"{self.sink.subscription.name}: the events before a failed one were not written again: {one_line(self._lost)}") from self._lost
        try:
            moved = next_offset is None or await self.sink.move_offset(self.transaction.esk, next_offset)
        except BaseException:
            await self.transaction.rollback()
            raise
        if not moved:
            await self.transaction.rollback()
            raise Fenced(f"{self.sink.subscription.name}: the offset of {self.sink.tp.topic}/{self.sink.tp.partition} moved under this member")
        await self.transaction.commit()
        if next_offset is not None:
            self.sink.expected = next_offset

    async def abort(self) -> None:
        if not self._over:
            self._over = True
            await self.transaction.rollback()

