"""The example saga against the real broker, processor and API: an order placed with
`pay_from` is paid once from that account, or cancelled when the account cannot pay; no
order is both; a replay of the whole saga (reset --to earliest) pays and cancels nothing
again, the processor answering the replayed command ids with their first outcomes."""

from __future__ import annotations

import dataclasses
from collections import Counter
from datetime import timedelta
from pathlib import Path

import httpx
import pytest

from domain.orders import orders
from esk.kafka.topics import ensure_topics, topic_specs
from esk.registry import load_registry
from esk.settings import Settings
from esk.subscriptions.operations import RefusedError, SubscriptionOperations
from subscriptions import payments
from tests.subscriptions.running import subscriber, subscriber_settings
from tests.system import api, events_topic, processor, read_topic, system, wait_for, with_state_dirs

pytestmark = pytest.mark.kafka

ORDERS = {  # order id -> the account it is paid from, and what becomes of it
    "o-paid": ("funded", "placed"),
    "o-paid-too": ("funded", "placed"),
    "o-empty": ("empty", "cancelled"),
    "o-unknown": ("nobody", "cancelled"),
    "o-closed": ("closed", "cancelled"),
    "o-cash": (None, "placed"),
}


async def post(client: httpx.AsyncClient, path: str, body: dict[str, object]) -> None:
    r = await client.post(path, json=body)
    assert r.status_code == 200, r.text


async def statuses(client: httpx.AsyncClient) -> dict[str, str]:
    return {o: (await client.get(f"/v1/orders/{o}")).json()["state"]["status"] for o in ORDERS}


async def test_orders_are_paid_once_or_cancelled_and_a_replay_changes_nothing(settings: Settings, tmp_path: Path) -> None:
    settings = subscriber_settings(settings, tmp_path / "subscriptions")
    async with system(settings) as running:
        client = running.client
        for account in ("funded", "empty", "closed"):
            await post(client, f"/v1/accounts/{account}/open", {"owner": account})
        await post(client, "/v1/accounts/funded/deposit", {"amount": 1000})
        await post(client, "/v1/accounts/closed/close", {})
        for order_id, (pay_from, _) in ORDERS.items():
            body = {"customer_id": "c1", "lines": [{"sku": "a", "qty": 3, "price": 100}]}
            await post(client, f"/v1/orders/{order_id}/place", body | ({"pay_from": pay_from} if pay_from else {}))
        expected = {o: status for o, (_, status) in ORDERS.items()}
        operations = SubscriptionOperations(settings, payments, running.registry)

        async with subscriber(settings, payments, running.registry) as member:
            await wait_for(lambda: _statuses_are(client, expected), what="every order paid or cancelled")
            # a paid order stays placed: its withdrawal shows in the account alone (open,
            # deposit and the two withdrawals: version 4), on another partition than the
            # cancellations, which may all come first
            funded = (await client.get("/v1/accounts/funded", params={"min_version": 4})).json()
            assert funded["state"]["balance"] == 400, funded
            await member.caught_up()
            with pytest.raises(RefusedError, match="running member"):
                await operations.reset(None)
        first = await _effects(settings)
        assert first == (Counter({"o-paid": 1, "o-paid-too": 1}), Counter({"o-empty": 1, "o-unknown": 1, "o-closed": 1}))

        await operations.reset(None)
        assert (await operations.status()).lag > 0
        async with subscriber(settings, payments, running.registry):
            # the replayed commands' outcomes are written again, and read again: wait for all of it
            await wait_for(lambda: _caught_up(operations), what="the replay to be over")
        assert await _effects(settings) == first
        assert await statuses(client) == expected
        assert (await client.get("/v1/accounts/funded")).json()["state"]["balance"] == 400


async def _caught_up(operations: SubscriptionOperations) -> bool:
    return (await operations.status()).caught_up


async def _statuses_are(client: httpx.AsyncClient, expected: dict[str, str]) -> bool:
    return await statuses(client) == expected


async def _effects(settings: Settings) -> tuple[Counter[str], Counter[str]]:
    """Withdrawals per order (the withdraw command's id names the order's Placed event), and
    cancellations per order, from the events topics."""
    withdrawn = Counter(
        e["command_id"].split("/")[1]
        for _, e, _ in await read_topic(settings, events_topic(settings, "accounts"))
        if e["type"] == "Withdrawn"
    )
    cancelled = Counter(e["aggregate_id"] for _, e, _ in await read_topic(settings, events_topic(settings, "orders")) if e["type"] == "Cancelled")
    return withdrawn, cancelled


async def test_an_order_placed_anew_after_it_expired_is_paid_anew(settings: Settings, tmp_path: Path) -> None:
    """A deleted order expires, and its id is placed again: its new Placed has the event id
    of the first (`orders/<id>/1`), and a command id derived from that alone was the first
    payment's, which the processor still remembered (its de-duplication window is days):
    answered as its duplicate, the second payment was dropped without a word."""
    registry = {**load_registry(settings.domain), "orders": dataclasses.replace(orders, retention=timedelta(seconds=1))}
    settings = subscriber_settings(settings, tmp_path / "subscriptions")
    settings = settings.model_copy(update={"processor": settings.processor.model_copy(update={"expiry_interval_s": 0.2})})
    await ensure_topics(settings, topic_specs(settings, registry))
    order = {"customer_id": "c1", "lines": [{"sku": "a", "qty": 1, "price": 100}], "pay_from": "twice"}
    async with api(with_state_dirs(settings, "a0"), registry) as client, processor(with_state_dirs(settings, "p0"), registry):
        await post(client, "/v1/accounts/twice/open", {"owner": "o"})
        await post(client, "/v1/accounts/twice/deposit", {"amount": 1000})
        async with subscriber(settings, payments, registry):
            await post(client, "/v1/orders/again/place", order)
            await wait_for(lambda: _balance_is(client, "twice", 900), what="the first payment")
            await post(client, "/v1/orders/again/delete", {})
            await wait_for(lambda: _gone(client, "/v1/orders/again"), what="the deleted order to expire")
            await post(client, "/v1/orders/again/place", order)
            await wait_for(lambda: _balance_is(client, "twice", 800), what="the second payment")
    withdrawn = [e["command_id"] for _, e, _ in await read_topic(settings, events_topic(settings, "accounts")) if e["type"] == "Withdrawn"]
    assert len(withdrawn) == 2 and withdrawn[0] != withdrawn[1], withdrawn


async def _balance_is(client: httpx.AsyncClient, account: str, balance: int) -> bool:
    return bool((await client.get(f"/v1/accounts/{account}")).json()["state"]["balance"] == balance)


async def _gone(client: httpx.AsyncClient, path: str) -> bool:
    return (await client.get(path)).status_code == 404
