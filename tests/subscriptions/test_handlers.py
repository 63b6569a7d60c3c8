"""Subscriptions without Kafka: the example handlers through `esk.run_subscription` (what a
user's own tests do), and what the worker does around any handler: routing by the type
header, upcasting, retries, parking in order, a failing event undone alone."""

from __future__ import annotations

import dataclasses
import functools
import logging
from pathlib import Path
from typing import Any, ClassVar

import msgspec
import pytest
from aiokafka import TopicPartition
from aiokafka.structs import ConsumerRecord
from prometheus_client import REGISTRY

from domain.accounts import Deposited, Opened, Withdraw, accounts
from domain.orders import Cancel, Line, LineAdded, Placed, Shipped, orders
from esk import (
    AggregateType,
    CommandOutcome,
    Context,
    DatabaseContext,
    DatabaseHandler,
    Event,
    Reactor,
    Retries,
    Send,
    SentCommand,
    SideEffectHandler,
    SQLite,
    run_subscription,
)
from esk.protocol import EventRecord, Outcome, Status
from esk.subscriptions.database_sink import DatabaseSink, load_parked, prepare, read_offsets
from esk.subscriptions.parking import ParkedEvent, ParkStatus
from esk.subscriptions.routing import HandlerMistake, Router, Undecodable, origin_of, reactor_commands
from esk.subscriptions.testing import Reply
from esk.subscriptions.worker import TAKEN_UP_BEHIND_NOTHING, WAITS_BEHIND, PartitionWorker, resolve_parked
from subscriptions import customer_ledger, payments

LINES = [Line(sku="apple", qty=2, price=150)]
NO_WAIT = Retries(attempts=1)


def placed(customer: str = "c1", pay_from: str | None = None, lines: list[Line] = LINES) -> Placed:
    return Placed(customer_id=customer, lines=lines, pay_from=pay_from)


# -- the example saga -------------------------------------------------------------------


async def test_an_order_with_pay_from_withdraws_its_total_under_an_id_derived_from_the_event() -> None:
    run = await run_subscription(payments, [("o1", placed(pay_from="a1")), ("o2", placed())])
    # the event's id and its place on its topic (partition 0, offset 0 here): an aggregate
    # created anew after it expired uses its event ids again
    assert run.commands == [SentCommand("payments:orders/o1/1@0.0:0", accounts, "a1", Withdraw(amount=300))]


async def test_handling_the_same_event_again_sends_the_same_command_id() -> None:
    first = await run_subscription(payments, [("o1", placed(pay_from="a1"))])
    again = await run_subscription(payments, [("o1", placed(pay_from="a1"))])
    assert [c.command_id for c in first.commands] == [c.command_id for c in again.commands]


async def test_a_refused_withdrawal_cancels_the_order_and_an_accepted_one_does_nothing() -> None:
    [withdrawal] = (await run_subscription(payments, [("o1", placed(pay_from="a1"))])).commands
    refused = await run_subscription(payments, [withdrawal.rejected("insufficient_funds")])
    assert refused.commands == [SentCommand("payments:payments:orders/o1/1@0.0:0:0", orders, "o1", Cancel())]
    accepted = await run_subscription(payments, [withdrawal.accepted(version=3)])
    assert accepted.commands == []


# -- the example database handler ---------------------------------------------------------


async def test_the_ledger_counts_orders_and_totals_per_customer() -> None:
    run = await run_subscription(
        customer_ledger,
        [("o1", placed("c1")), ("o2", placed("c2")), ("o1", LineAdded(sku="pear", qty=1, price=7)), ("o3", placed("c1"))],
    )
    assert await run.query("SELECT customer_id, orders, total FROM customer_ledger ORDER BY customer_id") == [
        ("c1", 2, 607),
        ("c2", 1, 300),
    ]
    assert run.parked == []
    await run.close()


# -- around any handler --------------------------------------------------------------------


def order_record(offset: int, order_id: str, event_type: str, value: bytes) -> ConsumerRecord[bytes, bytes]:
    return ConsumerRecord(
        topic="test.orders.events", partition=0, offset=offset, timestamp=0, timestamp_type=0, key=order_id.encode(),
        value=value, checksum=None, serialized_key_size=-1, serialized_value_size=-1,
        headers=[("esk-event-type", event_type.encode()), ("esk-schema-version", b"1")],
    )


def test_a_type_the_subscription_does_not_handle_is_passed_over_without_decoding() -> None:
    router = Router(customer_ledger, {"orders": orders}, "test")
    assert router.select(order_record(0, "o1", "Shipped", b"not even JSON")) is None
    route = router.select(order_record(1, "o1", "Placed", b"not even JSON"))
    assert route is not None
    with pytest.raises(Undecodable, match="not JSON"):
        router.decode(order_record(1, "o1", "Placed", b"not even JSON"), route)


def test_a_reactor_reads_only_the_outcomes_of_its_own_commands() -> None:
    router = Router(payments, {"orders": orders, "accounts": accounts}, "test")
    ours = Outcome("payments:orders/o1/1:0", "accounts", "a1", "withdraw", Status.ACCEPTED, 3)
    theirs = Outcome("api-key-1", "accounts", "a1", "withdraw", Status.ACCEPTED, 3)
    assert router.results_topic == "test.results"
    records = [
        ConsumerRecord(
            topic="test.results", partition=0, offset=n, timestamp=0, timestamp_type=0, key=b"a1", value=o.encode(),
            checksum=None, serialized_key_size=-1, serialized_value_size=-1, headers=[],
        )
        for n, o in enumerate([ours, theirs])
    ]
    assert [router.select(r) is not None for r in records] == [True, False]


@pytest.mark.parametrize(
    ("command_id", "origin"),
    [
        ("payments:orders/o1/1@2.1234:0", ("orders", "o1", 1)),
        ("payments:payments:orders/o1/7@0.5:0:2", ("orders", "o1", 7)),
        ("payments:orders/id@with/at@1.2/3@4.5:0", ("orders", "id@with/at@1.2", 3)),
        # derived before places were
        ("payments:orders/o1/1:0", ("orders", "o1", 1)),
        ("payments:orders/id@1.2/3:0", ("orders", "id@1.2", 3)),
        ("payments:payments:orders/o1/7:0:2", ("orders", "o1", 7)),
        ("payments:orders/id:with/slashes:and:colons/12:3", ("orders", "id:with/slashes:and:colons", 12)),
        ("someone-else", None),
        ("payments:not an event id", None),
    ],
)
def test_the_origin_of_a_derived_command_id(command_id: str, origin: tuple[str, str, int] | None) -> None:
    found = origin_of("payments", command_id)
    assert (None if found is None else (found.aggregate_type, found.aggregate_id, found.version)) == origin


async def test_an_event_of_an_older_schema_version_reaches_the_handler_upcast() -> None:
    seen: list[Opened] = []
    owners = SideEffectHandler("owners", reads=[accounts])

    @owners.on(Opened)
    async def opened(event: Opened, ctx: Context) -> None:
        seen.append(event)

    v1 = EventRecord("accounts/a1/1", "accounts", "a1", 1, "Opened", 1, {"name": "ada"}, "c", "c", "c", 0)
    record = ConsumerRecord(
        topic="test.accounts.events", partition=0, offset=0, timestamp=0, timestamp_type=0, key=b"a1", value=v1.encode(),
        checksum=None, serialized_key_size=-1, serialized_value_size=-1, headers=v1.headers(),
    )
    router = Router(owners, {"accounts": accounts}, "test")
    route = router.select(record)
    assert route is not None
    delivery = router.decode(record, route)
    assert delivery is not None
    await delivery.handler(delivery.event, None)
    assert seen == [Opened(owner="ada")]


def flaky_ledger(
    fails: dict[str, int], name: str = "flaky", aggregate: AggregateType[Any] = orders, placed: type[Placed] = Placed
) -> DatabaseHandler:
    """Records every event it applies, in order; raises for an order while `fails` says so."""
    ledger = DatabaseHandler(name, reads=[aggregate], schema=["CREATE TABLE applied (order_id TEXT, version INTEGER)"])

    async def apply(event: Any, ctx: DatabaseContext) -> None:
        await ctx.db.execute("INSERT INTO applied VALUES (?, ?)", (ctx.aggregate_id, ctx.version))
        if fails.get(ctx.aggregate_id, 0) > 0:
            fails[ctx.aggregate_id] -= 1
            raise RuntimeError(f"{ctx.aggregate_id} is not welcome")

    ledger.on(placed)(apply)
    ledger.on(LineAdded)(apply)
    return ledger


ADDED = LineAdded(sku="pear", qty=1, price=7)


async def test_a_failing_event_parks_its_aggregate_in_order_and_the_others_flow() -> None:
    run = await run_subscription(
        flaky_ledger({"bad": 99}),
        [("bad", placed()), ("good", placed()), ("bad", ADDED), ("good", ADDED), ("bad", ADDED)],
        retries=NO_WAIT,
    )
    # the failed handler's own insert was undone with it; the others' stayed
    assert await run.query("SELECT order_id, version FROM applied") == [("good", 1), ("good", 2)]
    assert [(p.aggregate_id, p.offset) for p in run.parked] == [("bad", 0), ("bad", 2), ("bad", 4)]
    assert run.parked[0].reason == "RuntimeError: bad is not welcome"
    assert run.parked[1].reason.startswith("waits behind")
    await run.close()


async def test_a_transient_failure_is_tried_again_and_not_parked() -> None:
    run = await run_subscription(
        flaky_ledger({"o1": 2}), [("o1", placed()), ("o2", placed())], retries=Retries(attempts=3, first_delay_s=0.01)
    )
    assert await run.query("SELECT order_id, version FROM applied") == [("o1", 1), ("o2", 1)]
    assert run.parked == []
    await run.close()


async def test_an_undecodable_event_is_parked_with_the_reason_and_its_aggregate_waits_behind_it() -> None:
    ledger = flaky_ledger({})
    database = SQLite(":memory:").connect(Path(":memory:"))
    await prepare(database, ledger)
    sink = DatabaseSink(database, ledger, TopicPartition("test.orders.events", 0))
    worker = PartitionWorker(ledger, Router(ledger, {"orders": orders}, "test"), sink, NO_WAIT)
    await worker.open()

    def event(n: int, order_id: str, version: int, event: Placed | LineAdded) -> ConsumerRecord[bytes, bytes]:
        data = event.model_dump(mode="json") if n != 0 else {"customer_id": 5}  # the first one is broken
        record = EventRecord(f"orders/{order_id}/{version}", "orders", order_id, version, event.type_name(), 1, data, "c", "c", "c", 0)
        return order_record(n, order_id, event.type_name(), record.encode())

    await worker.handle([event(0, "o1", 1, placed()), event(1, "o2", 1, placed()), event(2, "o1", 2, ADDED)], 3)
    async with database.transaction() as tx:
        parked = await load_parked(tx.esk, ledger.name)
        applied = await tx.sql.fetchall("SELECT order_id, version FROM applied")
        offsets = await read_offsets(tx.esk, ledger.name)
    assert [(p.offset, p.aggregate_id) for p in parked] == [(0, "o1"), (2, "o1")]
    # in one line, by its fields (pydantic's own text runs over several)
    assert parked[0].reason.startswith("undecodable: customer_id: ") and "\n" not in parked[0].reason
    assert applied == [("o2", 1)]
    assert offsets == {TopicPartition("test.orders.events", 0): (3, 0)}
    await database.close()


def test_a_handler_for_an_event_the_subscription_does_not_read_is_refused() -> None:
    sub = Reactor("wrong", reads=[orders])
    with pytest.raises(ValueError, match="none of them has the event Deposited"):
        sub.on(Deposited)
    with pytest.raises(ValueError, match="alphanumeric"):
        Reactor("no spaces", reads=[orders])
    assert Shipped in orders.events


def test_a_handler_that_is_not_async_is_refused_where_it_is_registered() -> None:
    sub = Reactor("sync", reads=[orders])

    def pay(event: Placed, ctx: Context) -> list[Send]:
        return []

    with pytest.raises(TypeError, match="'sync': the handler of Placed must be an `async def`"):
        sub.on(Placed)(pay)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="the outcome handler of Withdraw must be an `async def`"):
        sub.on_outcome(Withdraw)(pay)  # type: ignore[arg-type]

    class Callable:
        async def __call__(self, event: Placed, ctx: Context) -> list[Send]:
            return []

    sub.on(Placed)(Callable())

    async def pay_async(event: Placed, ctx: Context) -> list[Send]:
        return []

    @functools.wraps(pay_async)
    def decorated(event: Placed, ctx: Context) -> Any:  # a decorator's plain wrapper of an async def
        return pay_async(event, ctx)

    sub.on(Shipped)(decorated)
    assert Placed in sub.handlers and Shipped in sub.handlers


async def test_an_outcome_parked_is_named_by_its_command() -> None:
    """`esk subscriptions parked` and `retry` name what each entry is: an outcome's record has
    no event type in its headers (it showed as `?`)."""
    sub = Reactor("answered", reads=[orders])
    placed = ("o1", Placed(customer_id="c", lines=[]))

    @sub.on(Placed)
    async def pay(event: Placed, ctx: Context) -> list[Send]:
        return [Send(accounts, "a1", Withdraw(amount=1))]

    @sub.on_outcome(Withdraw)
    async def paid(outcome: CommandOutcome, ctx: Context) -> list[Send]:
        raise RuntimeError("not this one")

    [sent] = (await run_subscription(sub, [placed])).commands
    run = await run_subscription(sub, [placed, Reply(sent, Status.ACCEPTED, 2)], retries=Retries(attempts=1))
    assert [(p.event_type, p.reason) for p in run.parked] == [("outcome of withdraw", "RuntimeError: not this one")]


@pytest.mark.parametrize("answer", [None, "generator", "one Send", "a command"])
async def test_a_reactor_handler_that_answers_no_list_of_send_parks_its_event_at_once(answer: str | None) -> None:
    sub = Reactor("forgetful", reads=[orders])
    send = Send(accounts, "a1", Withdraw(amount=1))

    @sub.on(Placed)
    async def pay(event: Placed, ctx: Context) -> Any:
        if answer == "generator":
            return (s for s in [send])  # would be used up by the check, sending nothing
        if answer == "a command":
            return [Withdraw(amount=1)]  # not wrapped in Send
        return send if answer == "one Send" else None  # a `return` forgotten

    run = await run_subscription(sub, [("o1", placed()), ("o1", placed())], retries=Retries(attempts=3, first_delay_s=0.01))
    assert run.commands == []
    assert [(p.offset, p.attempts) for p in run.parked] == [(0, 1), (1, 0)]  # no retry: the same code answers the same
    told = {
        None: ", not None", "generator": ", not generator", "one Send": ", not Send", "a command": "; it held Withdraw(amount=1)"
    }[answer]
    assert run.parked[0].reason == f"HandlerMistake: a reactor handler returns a list of Send (`[]` for none){told}"


async def test_a_command_sent_to_an_aggregate_type_that_does_not_take_it_parks_its_event_at_once() -> None:
    sub = Reactor("mixed_up", reads=[orders])

    @sub.on(Placed)
    async def pay(event: Placed, ctx: Context) -> list[Send]:
        return [Send(orders, "o1", Withdraw(amount=1))]  # an accounts command

    run = await run_subscription(sub, [("o1", placed())], retries=Retries(attempts=3, first_delay_s=0.01))
    assert run.commands == [] and [p.attempts for p in run.parked] == [1]
    assert run.parked[0].reason == (
        "HandlerMistake: it sends Withdraw to orders, whose commands are Place (place), AddLine (add-line), Ship (ship), Cancel (cancel), Delete (delete)"
    )


async def test_a_command_sent_to_an_aggregate_type_the_domain_does_not_register_is_refused() -> None:
    """The processor would answer it unknown_aggregate_type, an outcome no one reads."""
    sub = Reactor("strays", reads=[orders])

    @sub.on(Placed)
    async def pay(event: Placed, ctx: Context) -> list[Send]:
        return [Send(accounts, "a1", Withdraw(amount=1))]

    record = order_record(0, "o1", "Placed", EventRecord(
        "orders/o1/1", "orders", "o1", 1, "Placed", Placed.schema_version, placed().model_dump(mode="json"), "c", "c", "c", 0
    ).encode())  # fmt: skip
    router = Router(sub, {"orders": orders}, "test")
    delivery = router.decode(record, router.select(record))  # type: ignore[arg-type]
    assert delivery is not None
    with pytest.raises(HandlerMistake, match=r"^it sends Withdraw to accounts, which ESK_DOMAIN does not register$"):
        await reactor_commands("strays", delivery, False, router.registry)
    assert await reactor_commands("strays", delivery, False, {"orders": orders, "accounts": accounts})


class PlacedNewer(Placed):
    """`Placed` as the next version of the code has it: one schema version on, same fields."""

    schema_version: ClassVar[int] = Placed.schema_version + 1

    @classmethod
    def type_name(cls) -> str:
        return "Placed"


NEWER_ORDERS = dataclasses.replace(
    orders,
    events=[PlacedNewer if e is Placed else e for e in orders.events],
    upcasters={**orders.upcasters, ("Placed", Placed.schema_version): dict},
)


RESULTS = ("parked_newer_version", "parked_behind", "parked", "handled")


async def test_events_parked_for_a_newer_schema_version_are_handled_once_the_code_knows_it() -> None:
    """A rolling deployment: the processor's newer code wrote an event version the
    subscriber's code did not know; the subscriber's next version knows it, and takes up
    the aggregate's parked events as it opens the partition, without an operator."""
    database = SQLite(":memory:").connect(Path(":memory:"))
    tp = TopicPartition("test.orders.events", 0)

    def event(n: int, order_id: str, version: int, event: Placed | LineAdded, schema_version: int) -> ConsumerRecord[bytes, bytes]:
        data = event.model_dump(mode="json")
        record = EventRecord(f"orders/{order_id}/{version}", "orders", order_id, version, event.type_name(), schema_version, data, "c", "c", "c", 0)
        return order_record(n, order_id, event.type_name(), record.encode())

    older = flaky_ledger({})
    await prepare(database, older)
    worker = PartitionWorker(older, Router(older, {"orders": orders}, "test"), DatabaseSink(database, older, tp), NO_WAIT)
    await worker.open()
    newer = PlacedNewer.schema_version

    def counted() -> list[float]:
        return [REGISTRY.get_sample_value("esk_subscription_events_total", {"subscription": older.name, "result": r}) or 0.0 for r in RESULTS]

    before = counted()
    await worker.handle([event(0, "o1", 1, placed(), newer), event(1, "o2", 1, placed(), 2), event(2, "o1", 2, ADDED, 1)], 3)
    async with database.transaction() as tx:
        parked = await load_parked(tx.esk, older.name)
    assert [(p.offset, p.reason.split(":")[:2]) for p in parked] == [(0, ["undecodable", " NewerSchemaVersion"]), (2, ["waits behind an earlier parked event of 'o1'"])]
    # Not counted as `parked`, which alerts: they wait for the newer code, not for someone.
    assert [after - b for after, b in zip(counted(), before, strict=True)] == [1, 1, 0, 1]

    again = PartitionWorker(older, Router(older, {"orders": orders}, "test"), DatabaseSink(database, older, tp), NO_WAIT)
    await again.open()  # the same code again: they stay parked, untouched
    assert again.parked == {"o1"}
    async with database.transaction() as tx:
        assert [p.attempts for p in await load_parked(tx.esk, older.name)] == [0, 0]

    upgraded = flaky_ledger({"o1": 1}, aggregate=NEWER_ORDERS, placed=PlacedNewer)  # its database away at first
    worker = PartitionWorker(upgraded, Router(upgraded, {"orders": NEWER_ORDERS}, "test"), DatabaseSink(database, upgraded, tp), NO_WAIT)
    await worker.open()
    assert worker.parked == {"o1"}  # all of them stay as they were, to be tried again
    async with database.transaction() as tx:
        assert [(p.reason.startswith("undecodable: NewerSchemaVersion"), p.attempts) for p in await load_parked(tx.esk, older.name)] == [
            (True, 0), (False, 0)
        ]
        assert await tx.sql.fetchall("SELECT order_id, version FROM applied") == [("o2", 1)]

    worker = PartitionWorker(upgraded, Router(upgraded, {"orders": NEWER_ORDERS}, "test"), DatabaseSink(database, upgraded, tp), NO_WAIT)
    assert await worker.open() == 3  # the next start
    assert worker.parked == set()
    await worker.handle([event(3, "o1", 3, ADDED, 1)], 4)  # and the aggregate's next events go on
    async with database.transaction() as tx:
        applied = await tx.sql.fetchall("SELECT order_id, version FROM applied")
        parked = await load_parked(tx.esk, upgraded.name)
        resolved = await load_parked(tx.esk, upgraded.name, status=None)
    assert applied == [("o2", 1), ("o1", 1), ("o1", 2), ("o1", 3)]
    assert parked == [] and {(p.status.value, p.resolved_by) for p in resolved} == {("retried", "esk: its schema version is known now")}
    await database.close()


class Refunded(Event):
    """An event type the next release adds to orders."""

    amount: int


WITH_REFUNDS = dataclasses.replace(orders, events=[*orders.events, Refunded])


@pytest.mark.parametrize("handled", [True, False], ids=["handled next", "not handled next"])
async def test_an_event_of_a_type_the_code_does_not_know_yet_waits_for_the_code_that_does(handled: bool) -> None:
    """A processor released before the subscribers writes an event type the next release
    adds: passed over as a type the subscription does not handle, it was lost to the next
    release's handler of it. It is parked as one of a newer version is, its aggregate's
    next events behind it, and taken up by the code that knows the type, whether or not a
    handler there takes it."""
    database = SQLite(":memory:").connect(Path(":memory:"))
    tp = TopicPartition("test.orders.events", 0)

    def event(n: int, order_id: str, version: int, event: Event) -> ConsumerRecord[bytes, bytes]:
        data = event.model_dump(mode="json")
        record = EventRecord(f"orders/{order_id}/{version}", "orders", order_id, version, event.type_name(), 1, data, "c", "c", "c", 0)
        return order_record(n, order_id, event.type_name(), record.encode())

    older = flaky_ledger({})
    await prepare(database, older)
    worker = PartitionWorker(older, Router(older, {"orders": orders}, "test"), DatabaseSink(database, older, tp), NO_WAIT)
    await worker.open()
    await worker.handle([event(0, "o1", 2, Refunded(amount=5)), event(1, "o2", 1, ADDED), event(2, "o1", 3, ADDED)], 3)
    async with database.transaction() as tx:
        parked = await load_parked(tx.esk, older.name)
        assert await tx.sql.fetchall("SELECT order_id, version FROM applied") == [("o2", 1)]
    assert [(p.offset, p.reason) for p in parked] == [
        (0, "undecodable: NewerSchemaVersion: orders event Refunded is of a type this code does not know: written by newer "
            "code (run that code, or add the type here)"),
        (2, "waits behind an earlier parked event of 'o1'"),
    ]

    upgraded = flaky_ledger({}, aggregate=WITH_REFUNDS)
    if handled:
        @upgraded.on(Refunded)
        async def refunded(event: Refunded, ctx: DatabaseContext) -> None:
            await ctx.db.execute("INSERT INTO applied VALUES (?, ?)", (f"refund {event.amount}", ctx.version))

    worker = PartitionWorker(upgraded, Router(upgraded, {"orders": WITH_REFUNDS}, "test"), DatabaseSink(database, upgraded, tp), NO_WAIT)
    assert await worker.open() == 3 and worker.parked == set()
    async with database.transaction() as tx:
        applied = await tx.sql.fetchall("SELECT order_id, version FROM applied")
    assert applied == [("o2", 1), *([("refund 5", 2)] if handled else []), ("o1", 3)]
    await database.close()


@pytest.mark.parametrize("then", ["taken up", "fails again", "a retry is first"])
async def test_events_parked_behind_one_a_retry_resolved_meanwhile_go_first_when_their_aggregate_comes_next(
    then: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A retry from the command line resolved an aggregate's first parked event just as the
    worker's batch, which had read it was parked, parked the next one behind it: the
    aggregate's next event finds that one parked behind nothing, and the worker handles it
    first, in order, without waiting for the partition's next open. When it fails again,
    the aggregate's events park behind it, tried once, not at each event; when another
    retry resolves it first, the aggregate's events flow."""
    database = SQLite(":memory:").connect(Path(":memory:"))
    tp = TopicPartition("test.orders.events", 0)
    fails = {"o1": 1}
    ledger = flaky_ledger(fails)
    await prepare(database, ledger)
    sink = DatabaseSink(database, ledger, tp)
    router = Router(ledger, {"orders": orders}, "test")
    worker = PartitionWorker(ledger, router, sink, NO_WAIT)
    await worker.open()

    def event(n: int, version: int, event: Placed | LineAdded) -> ConsumerRecord[bytes, bytes]:
        record = EventRecord(f"orders/o1/{version}", "orders", "o1", version, event.type_name(), 1, event.model_dump(mode="json"), "c", "c", "c", 0)
        return order_record(n, "o1", event.type_name(), record.encode())

    await worker.handle([event(0, 1, placed()), event(1, 2, ADDED)], 2)
    unit = await sink.begin()
    first, behind = await unit.parked_of("o1")
    assert behind.reason.startswith(WAITS_BEHIND)
    # The retry, as `esk subscriptions retry` runs it, read the aggregate's parked events
    # before the batch parked the second one.
    assert (await resolve_parked(unit, router, [first], ParkStatus.RETRIED, "ops"))[1] == []
    await unit.commit(None)
    behind_before = REGISTRY.get_sample_value("esk_subscription_events_total", {"subscription": ledger.name, "result": "parked_behind"}) or 0

    if then == "a retry is first":
        taken_up = worker._take_up

        async def after_a_retry(keys: list[str]) -> None:
            unit = await sink.begin()
            parked = await unit.parked_to_resolve("o1")
            assert (await resolve_parked(unit, router, parked, ParkStatus.RETRIED, "ops again"))[1] == []
            await unit.commit(None)
            await taken_up(keys)

        monkeypatch.setattr(worker, "_take_up", after_a_retry)
    if then == "fails again":
        fails["o1"] = 5
        await worker.handle([event(2, 3, ADDED)], 3)
        await worker.handle([event(3, 4, ADDED)], 4)
        assert fails["o1"] == 4  # one attempt of the event parked behind nothing
        assert worker.parked == {"o1"}
        async with database.transaction() as tx:
            assert [p.offset for p in await load_parked(tx.esk, ledger.name)] == [1, 2, 3]
        await database.close()
        return

    await worker.handle([event(2, 3, ADDED)], 3)
    assert worker.parked == set()
    async with database.transaction() as tx:
        assert await tx.sql.fetchall("SELECT order_id, version FROM applied") == [("o1", 1), ("o1", 2), ("o1", 3)]
        assert await load_parked(tx.esk, ledger.name) == []
        resolved = await load_parked(tx.esk, ledger.name, status=None)
        assert await read_offsets(tx.esk, ledger.name) == {tp: (3, 0)}
    assert [(p.offset, p.status, p.resolved_by) for p in resolved] == [
        (0, ParkStatus.RETRIED, "ops"),
        (1, ParkStatus.RETRIED, "ops again" if then == "a retry is first" else TAKEN_UP_BEHIND_NOTHING),
    ]
    after = REGISTRY.get_sample_value("esk_subscription_events_total", {"subscription": ledger.name, "result": "parked_behind"}) or 0
    assert after == behind_before
    await database.close()


async def test_an_event_parked_behind_nothing_is_handled_at_the_next_start() -> None:
    """A batch that checked its aggregate was parked just before a retry from the command
    line resolved it parks the next event behind nothing: the next start takes it up."""
    database = SQLite(":memory:").connect(Path(":memory:"))
    tp = TopicPartition("test.orders.events", 0)
    ledger = flaky_ledger({})
    await prepare(database, ledger)
    sink = DatabaseSink(database, ledger, tp)
    worker = PartitionWorker(ledger, Router(ledger, {"orders": orders}, "test"), sink, NO_WAIT)
    await worker.open()
    await worker.handle([], 4)
    record = EventRecord("orders/o1/2", "orders", "o1", 2, "LineAdded", 1, ADDED.model_dump(mode="json"), "c", "c", "c", 0)
    unit = await sink.begin()
    await unit.park(ParkedEvent.of(ledger.name, order_record(3, "o1", "LineAdded", record.encode()), f"{WAITS_BEHIND}'o1'", 0))
    await unit.commit(None)

    again = PartitionWorker(ledger, Router(ledger, {"orders": orders}, "test"), DatabaseSink(database, ledger, tp), NO_WAIT)
    assert await again.open() == 4
    assert again.parked == set()
    async with database.transaction() as tx:
        assert await tx.sql.fetchall("SELECT order_id, version FROM applied") == [("o1", 2)]
        [resolved] = await load_parked(tx.esk, ledger.name, status=None)
    assert (resolved.status, resolved.resolved_by) == (ParkStatus.RETRIED, TAKEN_UP_BEHIND_NOTHING)
    await database.close()


async def test_a_parked_event_that_needs_someone_is_a_warning_and_one_that_waits_on_its_own_is_not(caplog: pytest.LogCaptureFixture) -> None:
    """A rolling release parks thousands of events for newer code, or behind one: INFO."""
    sub = SideEffectHandler("failing", reads=[orders])

    @sub.on(Placed)
    async def fail(event: Placed, ctx: Context) -> None:
        raise RuntimeError("a bug")

    caplog.set_level(logging.INFO, logger="esk.subscriptions.worker")
    run = await run_subscription(sub, [("o1", placed()), ("o1", placed())], retries=NO_WAIT)
    assert len(run.parked) == 2
    levels = [(r.levelname, "waits behind" in r.getMessage()) for r in caplog.records if ": parked " in r.getMessage()]
    assert levels == [("WARNING", False), ("INFO", True)]


def test_a_parked_entry_keeps_each_earlier_resolution_of_its_position_and_reads_entries_written_before_them() -> None:
    first = ParkedEvent("s", "t", 0, 3, "a", "Placed", "no", 1, b"a", b"{}", [])
    skipped = first.resolved(ParkStatus.SKIPPED, "alice")
    again = msgspec.structs.replace(first, reason="still no").after(skipped).resolved(ParkStatus.RETRIED, "bob")
    third = msgspec.structs.replace(first, reason="no again").after(again)
    assert [(r.status, r.by, r.reason) for r in third.earlier] == [
        (ParkStatus.SKIPPED, "alice", "no"), (ParkStatus.RETRIED, "bob", "still no")
    ]
    assert first.after(None) == first
    assert third.after(third).earlier == third.earlier  # written twice (a crash before the offset): nothing to add
    # as a parked topic's entry of an earlier release reads
    old = msgspec.json.encode({f: v for f, v in msgspec.structs.asdict(skipped).items() if f != "earlier"})
    assert ParkedEvent.decode(old) == skipped and ParkedEvent.decode(third.encode()) == third
