"""A subscriber asked to stop (SIGTERM), or whose partitions a rebalance takes away, lets the
chunks in hand go on to their commit, for a bounded time, against the real broker: a rollout
or a scale-out would otherwise throw away up to a fetch of handled work, for the partition's
next owner to do all over again."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from domain.orders import Placed, orders
from esk import Context, DatabaseContext, DatabaseHandler, Retries, SideEffectHandler
from esk.settings import Settings
from tests.subscriptions.running import subscriber, subscriber_settings
from tests.system import System, system, wait_for

pytestmark = pytest.mark.kafka

in_hand = asyncio.Event()  # set once the handler has written the order's row
HANDLER_S = 1.5

slow = DatabaseHandler("stopping_ledger", reads=[orders], schema=["CREATE TABLE IF NOT EXISTS seen (order_id TEXT)"])


@slow.on(Placed)
async def placed(event: Placed, ctx: DatabaseContext) -> None:
    await ctx.db.execute("INSERT INTO seen VALUES (?)", (ctx.aggregate_id,))
    in_hand.set()
    await asyncio.sleep(HANDLER_S)  # a slow handler: the stop comes while its chunk is in hand


@contextlib.asynccontextmanager
async def _placed(settings: Settings, order_id: str) -> AsyncIterator[System]:
    """A system in which order `order_id` was placed."""
    async with system(settings) as s:
        order = {"customer_id": "c1", "lines": [{"sku": "a", "qty": 1, "price": 1}]}
        assert (await s.client.post(f"/v1/orders/{order_id}/place", json=order)).status_code == 200
        yield s


def _with_grace(settings: Settings, grace_s: float) -> Settings:
    return settings.model_copy(update={"subscriber": settings.subscriber.model_copy(update={"stop_grace_s": grace_s})})


def _seen(data_dir: Path) -> list[tuple[object, ...]]:
    with sqlite3.connect(data_dir / "stopping_ledger.sqlite") as db:
        return db.execute("SELECT order_id FROM seen").fetchall()


@pytest.mark.parametrize("grace_s", [30.0, 0.0])
async def test_a_stop_lets_the_chunk_in_hand_commit_within_its_grace(settings: Settings, tmp_path: Path, grace_s: float) -> None:
    in_hand.clear()
    data_dir = tmp_path / "subscriptions"
    settings = _with_grace(subscriber_settings(settings, data_dir), grace_s)
    async with _placed(settings, "o-stop") as s:
        async with subscriber(settings, slow, s.registry) as running:
            await asyncio.wait_for(in_hand.wait(), 60)
            await running.shutdown()  # as SIGTERM asks
    # with a grace, its row and offset committed; without one, given up for the next owner
    assert _seen(data_dir) == ([("o-stop",)] if grace_s else [])


calls: list[str] = []  # each call of `mailer`, by aggregate
revoking = asyncio.Event()  # set once aiokafka takes partitions away from a member


class _Revoking(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("Revoking previously assigned partitions") and isinstance(record.args, tuple) and record.args[0]:
            revoking.set()


mailer = SideEffectHandler("rebalanced_mailer", reads=[orders])


@mailer.on(Placed)
async def mail(event: Placed, ctx: Context) -> None:
    calls.append(ctx.aggregate_id)
    # in hand until the rebalance takes its partition away (a second member joins), and a
    # while after: the revoke finds it still running
    await revoking.wait()
    await asyncio.sleep(1)


@pytest.mark.parametrize("grace_s", [30.0, 0.0])
async def test_a_rebalance_lets_the_chunk_in_hand_commit_before_its_partition_moves(settings: Settings, tmp_path: Path, grace_s: float) -> None:
    calls.clear()
    revoking.clear()
    settings = _with_grace(subscriber_settings(settings, tmp_path / "subscriptions"), grace_s)
    watch = _Revoking()
    coordinator_log = logging.getLogger("aiokafka.consumer.group_coordinator")
    level = coordinator_log.level
    coordinator_log.addHandler(watch)
    coordinator_log.setLevel(logging.INFO)
    try:
        async with _placed(settings, "o-rebalance") as s:
            async with subscriber(settings, mailer, s.registry) as first:
                await wait_for(lambda: bool(calls), 60, "the first member to take the order in hand")
                async with subscriber(settings, mailer, s.registry) as second:
                    await wait_for(lambda: bool(first.runner.partitions) and bool(second.runner.partitions), 60, "the group to share the partitions")
                    await first.caught_up()
                    await second.caught_up()
    finally:
        coordinator_log.removeHandler(watch)
        coordinator_log.setLevel(level)
    # with a grace, its offset committed as the partition moved: neither member mailed it
    # again; without one, given up, and mailed again by the partition's next owner
    assert calls == (["o-rebalance"] if grace_s else ["o-rebalance", "o-rebalance"])


swallowed = asyncio.Event()
stubborn = SideEffectHandler("stubborn_mailer", reads=[orders])


@stubborn.on(Placed)
async def stubborn_mail(event: Placed, ctx: Context) -> None:
    calls.append(ctx.aggregate_id)
    try:
        await asyncio.sleep(600)
    except asyncio.CancelledError:
        swallowed.set()  # as an `except BaseException` does, or 3.11's wait_for at the wrong moment
    await asyncio.sleep(600)


async def test_a_handler_that_swallows_its_cancellation_does_not_hold_a_stop_up(
    settings: Settings, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    calls.clear()
    swallowed.clear()
    settings = _with_grace(subscriber_settings(settings, tmp_path / "subscriptions"), 0.0)
    async with _placed(settings, "o-stubborn") as s:
        async with subscriber(settings, stubborn, s.registry) as running:
            await wait_for(lambda: bool(calls), 60, "the order in hand")
            await running.shutdown()  # within its 60 s, not the handler's 600
    assert swallowed.is_set()
    assert "went on after it was cancelled (its handler swallowed the cancellation?): cancelled again" in caplog.text


failures: list[str] = []
backing_off = SideEffectHandler("backing_off_mailer", reads=[orders], retries=Retries(attempts=3, first_delay_s=600, max_delay_s=600))


@backing_off.on(Placed)
async def failing_mail(event: Placed, ctx: Context) -> None:
    failures.append(ctx.aggregate_id)
    raise ConnectionError("the mail server does not answer")


async def test_a_stop_does_not_wait_for_a_partition_that_waits_to_try_again(settings: Settings, tmp_path: Path) -> None:
    """Nothing of it is in hand: what came before the failed event is committed, and the
    event is the next owner's to try, at once."""
    failures.clear()
    settings = _with_grace(subscriber_settings(settings, tmp_path / "subscriptions"), 120.0)
    async with _placed(settings, "o-backoff") as s:
        async with subscriber(settings, backing_off, s.registry) as running:
            await wait_for(lambda: bool(failures), 60, "the first attempt")
            asked = time.monotonic()
            await running.shutdown()
            stopped_s = time.monotonic() - asked
        # not its 120 s of grace, nor the 600 s of its backoff
        assert stopped_s < 60, stopped_s
        async with subscriber(settings, backing_off, s.registry):
            await wait_for(lambda: len(failures) == 2, 60, "the next run to try the event at once")
