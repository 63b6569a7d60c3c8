"""The suite's PostgreSQL is a real server with real transactions: what a fake would get wrong
(visibility across connections, row locks, a compare-and-set losing to a committed writer,
savepoints) is checked here once, so tests built on `postgres_dsn` can rely on it."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import psycopg
import pytest

from tests.postgres import PostgresServer


def test_server_is_ours_and_the_database_is_fresh(postgres: PostgresServer, postgres_dsn: str) -> None:
    with psycopg.connect(postgres_dsn) as conn:
        row = conn.execute(
            "SELECT inet_server_port(), current_database(), current_setting('fsync'),"
            " current_setting('server_version_num')::int,"
            " (SELECT count(*) FROM pg_tables WHERE schemaname = 'public')"
        ).fetchone()
    assert row is not None
    port, database, fsync, version_num, tables = row
    # Its own port, not Debian's cluster on 5432; its own empty database per test.
    assert port == postgres.port != 5432
    assert database.startswith("t_") and postgres_dsn.endswith(f"/{database}")
    assert fsync == "off"
    assert version_num // 10000 == int(postgres.version)
    assert tables == 0


def test_isolation_compare_and_set_and_savepoint(postgres_dsn: str) -> None:
    with psycopg.connect(postgres_dsn, autocommit=True) as setup:
        setup.execute("CREATE TABLE kv (k text PRIMARY KEY, v bigint NOT NULL)")
        setup.execute("INSERT INTO kv VALUES ('a', 1)")

    with psycopg.connect(postgres_dsn) as first, psycopg.connect(postgres_dsn) as second:
        # Read committed: an uncommitted insert is invisible to the other connection, then visible.
        first.execute("INSERT INTO kv VALUES ('b', 10)")
        assert second.execute("SELECT count(*) FROM kv WHERE k = 'b'").fetchone() == (0,)
        first.commit()
        assert second.execute("SELECT count(*) FROM kv WHERE k = 'b'").fetchone() == (1,)
        second.commit()

        # Both read v = 1; the first locks the row, so the second's compare-and-set must wait for
        # it, then re-check its WHERE against the committed row and update nothing.
        assert second.execute("SELECT v FROM kv WHERE k = 'a'").fetchone() == (1,)
        assert first.execute("SELECT v FROM kv WHERE k = 'a' FOR UPDATE").fetchone() == (1,)
        second.execute("SET lock_timeout = '10s'")
        with ThreadPoolExecutor(max_workers=1) as pool:
            stale = pool.submit(lambda: second.execute("UPDATE kv SET v = 2 WHERE k = 'a' AND v = 1").rowcount)
            _wait_until_blocked_on_a_lock(postgres_dsn)
            assert not stale.done()
            assert first.execute("UPDATE kv SET v = 2 WHERE k = 'a' AND v = 1").rowcount == 1
            first.commit()
            assert stale.result(timeout=10) == 0
        second.commit()
        assert second.execute("SELECT v FROM kv WHERE k = 'a'").fetchone() == (2,)
        second.commit()

        # A savepoint rolls back alone, even after a real constraint violation, and the
        # transaction around it goes on and commits.
        first.execute("INSERT INTO kv VALUES ('c', 1)")
        first.execute("SAVEPOINT s")
        first.execute("INSERT INTO kv VALUES ('d', 1)")
        with pytest.raises(psycopg.errors.UniqueViolation):
            first.execute("INSERT INTO kv VALUES ('a', 99)")
        first.execute("ROLLBACK TO SAVEPOINT s")
        first.execute("INSERT INTO kv VALUES ('e', 1)")
        first.commit()
        rows = second.execute("SELECT k, v FROM kv ORDER BY k").fetchall()
        assert rows == [("a", 2), ("b", 10), ("c", 1), ("e", 1)]


def _wait_until_blocked_on_a_lock(dsn: str, timeout_s: float = 10.0) -> None:
    """Until some session of this test's database waits on a lock, as the server itself reports it."""
    deadline = time.monotonic() + timeout_s
    with psycopg.connect(dsn, autocommit=True) as observer:
        while True:
            row = observer.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
            ).fetchone()
            if row is not None and row[0] > 0:
                return
            if time.monotonic() > deadline:
                raise TimeoutError("the second writer never blocked on the first one's row lock")
            time.sleep(0.01)
