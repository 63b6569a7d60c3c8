"""A database handler whose PostgreSQL database does not answer, against the real broker and
server: the subscriber waits for it at its start, as it waits for a broker, and takes its
events once it answers; the operator's commands say so in a line, and the status of the
subscriptions that keep their offsets in Kafka still shows."""

from __future__ import annotations

import asyncio
import gc
import logging
from pathlib import Path

import psycopg
import pytest
from typer.testing import CliRunner

from domain.orders import Placed, orders
from esk import DatabaseContext, DatabaseHandler, PostgreSQL
from esk.broker.ports import free_port
from esk.cli import cli
from esk.kafka.topics import ensure_topics, topic_specs
from esk.registry import load_registry
from esk.settings import Settings
from subscriptions import customer_ledger
from tests.postgres import PostgresServer
from tests.subscriptions.running import subscriber, subscriber_settings
from tests.system import system, wait_for

pytestmark = pytest.mark.kafka


def _placed_log(dsn: str) -> DatabaseHandler:
    handler = DatabaseHandler(
        "placed_log", reads=[orders], database=PostgreSQL(dsn),
        schema=["CREATE TABLE IF NOT EXISTS placed (order_id TEXT PRIMARY KEY)"],
    )

    @handler.on(Placed)
    async def _placed(event: Placed, ctx: DatabaseContext) -> None:
        await ctx.db.execute("INSERT INTO placed VALUES (%s)", (ctx.aggregate_id,))

    return handler


# What `esk subscriptions` imports (ESK_SUBSCRIPTIONS): one whose database is where nothing
# listens, beside the example's ledger (SQLite)
SUBSCRIPTIONS = [_placed_log("postgresql://nobody@127.0.0.1:9/none"), customer_ledger]


async def test_a_subscriber_waits_for_its_database_at_its_start(
    settings: Settings, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server that is not there yet (down, or its pod not scheduled): waited for, then its
    events are taken; one gone later is told by /readyz until it is back. A server that answers and refuses the DSN (a role, a password, a
    database that is not there) is a mistake no wait mends: the subscriber fails with it."""
    caplog.set_level(logging.INFO, logger="esk.subscriptions.runner")
    port = free_port()
    server = PostgresServer()
    monkeypatch.setattr("tests.postgres.free_port", lambda: port)  # where the subscriber looks
    handler = _placed_log(f"postgresql://{server.user}@127.0.0.1:{port}/postgres")
    settings = subscriber_settings(settings, tmp_path / "subscriptions")
    try:
        async with system(settings) as running:
            r = await running.client.post("/v1/orders/o1/place", json={"customer_id": "c1", "lines": [{"sku": "a", "qty": 1, "price": 1}]})
            assert r.status_code == 200, r.text
            async with subscriber(settings, handler, running.registry) as member:
                await wait_for(lambda: "does not answer, waiting for it" in caplog.text, what="the subscriber to wait")
                await asyncio.sleep(1)
                assert not member.task.done() and not member.runner.ready  # it waits; it did not fail
                assert caplog.text.count("does not answer, waiting for it") == 1  # told once
                await asyncio.to_thread(server.start)
                await member.caught_up()
                assert member.runner.ready
                # Gone once it ran: /readyz tells it (its partitions fail) until it is back.
                await asyncio.to_thread(server.down)
                r = await running.client.post("/v1/orders/o2/place", json={"customer_id": "c1", "lines": [{"sku": "a", "qty": 1, "price": 1}]})
                assert r.status_code == 200, r.text
                await wait_for(lambda: not member.runner.ready, what="the subscriber to be told not ready")
                await asyncio.to_thread(server.up)
                await member.caught_up()
                await wait_for(lambda: member.runner.ready, what="the subscriber to be ready again")
            with server.connect("postgres") as db:
                assert db.execute("SELECT order_id FROM placed ORDER BY order_id").fetchall() == [("o1",), ("o2",)]
            assert "placed_log: its database answers, after " in caplog.text

            refused = _placed_log(f"postgresql://nobody@127.0.0.1:{port}/postgres")  # no such role
            async with subscriber(settings, refused, running.registry) as failing:
                with pytest.raises(psycopg.OperationalError, match='role "nobody" does not exist'):
                    await asyncio.wait_for(failing.task, 30)
            del failing
            gc.collect()  # a consumer left open says so as it goes
            assert "Unclosed AIOKafkaConsumer" not in caplog.text
    finally:
        await asyncio.to_thread(server.stop)


def test_the_operators_commands_say_in_a_line_that_its_database_does_not_answer(
    settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for variable, value in {
        "ESK_APP": settings.app,
        "ESK_KAFKA__BOOTSTRAP_SERVERS": settings.bootstrap_servers,
        "ESK_SUBSCRIPTIONS": f"{__name__}:SUBSCRIPTIONS",
        "ESK_SUBSCRIBER__DATA_DIR": str(tmp_path),
        "COLUMNS": "250",
    }.items():
        monkeypatch.setenv(variable, value)
    asyncio.run(ensure_topics(settings, topic_specs(settings, load_registry(settings.domain))))
    for command in (["status", "placed_log"], ["parked", "placed_log"], ["retry", "placed_log"], ["reset", "placed_log", "--to", "earliest", "--keep-data"]):
        told = CliRunner().invoke(cli, ["subscriptions", *command])
        assert told.exit_code == 1, told.output
        [line] = [line for line in told.output.splitlines() if line.strip()]
        assert line.startswith("error: placed_log: its database postgresql://127.0.0.1:9/none does not answer (OperationalError: "), line
    # every subscription's status: the other's still shows
    told = CliRunner().invoke(cli, ["subscriptions", "status"])
    assert told.exit_code == 1 and "error: placed_log: its database" in told.output, told.output
    assert "customer_ledger: caught up" in told.output, told.output
