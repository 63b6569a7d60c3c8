"""PartitionWorker: one input partition of a subscription, its records handled in order.

For each record: is it the subscription's (routing, no decoding)? Is its aggregate parked
(then it is parked behind)? Does it decode (else it is parked with the reason)? Then its
handler runs into the open unit. A handler that raises is undone alone: the unit commits
what came before it, and the event is tried again on its own, with growing waits, each
attempt a unit of its own; when the attempts run out it is parked, in the unit that moves
the offset past it. The worker knows nothing of Kafka or databases: its sink does.

An aggregate parked behind an event of a schema version the code did not know (newer code
wrote it while this subscriber still ran older code, as a rolling deployment does) is
handled again when a worker opens its partition with code that knows the version: as
`esk subscriptions retry` would, so an upgrade needs no operator. So is one whose first
parked event waits behind nothing (parked behind one that a retry or skip from the
command line resolved in the same moment). All of the aggregate's parked events go
through, or none (one that fails for another reason keeps them all parked, tried again at
the next start).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from aiokafka.structs import ConsumerRecord
from opentelemetry.trace import SpanKind

from .. import tracing
from ..domain.aggregate import one_line
from ..kafka.acls import AUTHORIZATION_REFUSED
from ..metrics import SUBSCRIPTION_EVENTS
from .api import AnySubscription, Retries
from .parking import NEWER_VERSION, UNDECODABLE, WAITS_BEHIND, ParkedEvent, ParkStatus, aggregate_key, parked_result
from .routing import Delivery, EventDelivery, HandlerMistake, Router, Undecodable
from .sinks import Fenced, PartitionSink, Unit, is_ahead

log = logging.getLogger(__name__)

# Who resolved the parked events esk handled on its own as it opened a partition.
TAKEN_UP_VERSION_KNOWN = "esk: its schema version is known now"
TAKEN_UP_BEHIND_NOTHING = "esk: nothing is parked before it"
# ... and who marked reset the events it found parked past the partition's offset.
PASSED_AGAIN = "esk: the partition's offset is back before it"


class FailedWithItsUnit(Exception):
    """An event's handler failed and took its unit with it (the database connection lost, or
    the transaction ended by the database): what came before it in the unit is lost too, so
    the partition starts again, and the event, met again, is tried alone (`suspects`)."""

    def __init__(self, offset: int, error: Exception) -> None:
        super().__init__(
            f"the handler of offset {offset} failed ({one_line(error)}), and what came before it could not be committed "
            "without it: the partition starts again and tries it alone"
        )
        self.offset = offset
        self.error = error


class PartitionWorker:
    def __init__(
        self,
        subscription: AnySubscription,
        router: Router,
        sink: PartitionSink,
        retries: Retries | None = None,
        traced: bool = False,
        suspects: dict[int, Exception] | None = None,
    ) -> None:
        self.subscription = subscription
        self.router = router
        self.sink = sink
        self.retries = retries or subscription.retries
        # offset -> the failure of an event that took its unit with it, kept by the caller
        # across the partition's starts
        self.suspects = {} if suspects is None else suspects
        self.next_offset: int | None = None  # as of the last commit; None: nothing committed yet
        self.replay_until = 0
        self.parked: set[str] = set()
        self._not_taken_up: set[str] = set()  # parked behind nothing, and failed again when taken up
        # waiting to try a failed event again, with all before it committed: nothing in hand
        # that a stop or a rebalance should wait for
        self.backing_off = False
        self._traced = traced
        self._handled = SUBSCRIPTION_EVENTS.labels(subscription.name, "handled")
        # handled since the last commit: counted once per commit, as `inc()` takes a lock
        self._uncounted = 0

    async def open(self) -> int | None:
        """Take the partition; return the offset to read from (None: its beginning)."""
        start = await self.sink.open()
        self.next_offset = start.next_offset
        self.replay_until = start.replay_until
        self.parked = set(start.parked)
        if start.parked_ahead:
            await self._mark_ahead(start.parked_ahead)
        await self._take_up(sorted(key for key, reason in start.parked.items() if reason.startswith((NEWER_VERSION, WAITS_BEHIND))))
        return start.next_offset

    async def _mark_ahead(self, offsets: Sequence[int]) -> None:
        """Events still parked at `offsets`, past the partition's offset, marked reset, as
        `esk subscriptions reset` would have: the pass from the offset handles them again
        (and parks them again, keeping this, if they fail again). Left parked, each would
        wait behind itself, its first reason lost."""
        unit = await self.sink.begin()
        marked = 0
        try:
            for offset in offsets:
                entry = await unit.entry_at(offset)
                if entry is not None and entry.status is ParkStatus.PARKED:
                    await unit.park(entry.resolved(ParkStatus.RESET, PASSED_AGAIN))
                    marked += 1
        except BaseException as failure:
            await _abort_for(unit, failure)
            raise
        await unit.commit(None)
        log.warning("%s: %d events parked past the partition's offset are marked reset, to be handled again", self.subscription.name, marked)

    def _behind(self, parked: list[ParkedEvent]) -> list[ParkedEvent]:
        """Those of `parked` before the partition's offset: one past it was marked reset as the
        partition opened (`_mark_ahead`), which a read of a Kafka kind's parked topic may not
        show yet (a transaction's markers are written after its commit returns)."""
        return [event for event in parked if not is_ahead(event.offset, self.next_offset)]

    async def _take_up(self, keys: Sequence[str]) -> None:
        """`keys`: the aggregates whose first parked event may need no operator."""
        for key in keys:
            unit = await self.sink.begin()
            try:
                parked = self._behind(await unit.parked_to_resolve(key))  # as of now: a retry from the command line may have been first
                if not parked:
                    await unit.abort()
                    self.parked.discard(key)
                    continue
                by = self._taken_up_by(parked[0])
                if by is None:
                    await unit.abort()
                    continue
                resolved, still_parked = await resolve_parked(unit, self.router, parked, ParkStatus.RETRIED, by)
            except Fenced:
                await unit.abort()
                raise
            except AUTHORIZATION_REFUSED:  # the parked topic's read refused: no retry helps (SubscriptionRunner)
                await _abort_quietly(unit)
                raise
            except Exception as error:  # a handler's failure took the unit with it (its database transaction ended)
                await _abort_quietly(unit)
                self._not_taken_up.add(key)
                log.warning("%s: %s's parked events stay parked: %s", self.subscription.name, key, one_line(error))
                continue
            except BaseException as failure:
                await _abort_for(unit, failure)
                raise
            if still_parked:
                # One failed now, for another reason (its handler, a database away): all of
                # them stay as they were, to be tried at the next start, or by an operator.
                await unit.abort()
                log.warning("%s: %s's parked events stay parked (%s): %s", self.subscription.name, key, by, still_parked[0].reason)
                continue
            await unit.commit(None)
            self.parked.discard(key)
            log.info("%s: %s's %d parked events are handled (%s)", self.subscription.name, key, len(resolved), by)

    def _taken_up_by(self, first: ParkedEvent) -> str | None:
        """Why esk handles an aggregate's parked events on its own, `first` the first of
        them; None: they wait for an operator."""
        if first.reason.startswith(WAITS_BEHIND):
            return TAKEN_UP_BEHIND_NOTHING
        if first.reason.startswith(NEWER_VERSION) and _decodes(self.router, first):
            return TAKEN_UP_VERSION_KNOWN
        return None

    async def close(self) -> None:
        await self.sink.close()

    async def handle(self, records: Sequence[ConsumerRecord[bytes, bytes]], end_offset: int) -> None:
        """Handle `records` (in offset order) and commit up to `end_offset`, the position
        after them (which may be further on: transaction markers take offsets too). Nothing
        to handle and nothing to move: only check that the partition is still this member's."""
        if not records and end_offset == self.next_offset:
            await self.sink.verify()
            return
        verified: set[str] = set()  # parked aggregates checked against the store during this call
        unit = await self.sink.begin()
        try:
            for record in records:
                if self.next_offset is not None and record.offset < self.next_offset:
                    continue  # fetched before a restart moved the position on
                route = self.router.select(record)
                if route is None:
                    continue
                key = aggregate_key(record)
                if key in self.parked and key not in verified:
                    unit = await self._check_parked(unit, key, record.offset, verified)
                if key in self.parked:
                    await self._park(unit, record, f"{WAITS_BEHIND}{key!r}", 0, verified)
                    continue
                try:
                    delivery = self.router.decode(record, route)
                except Undecodable as error:
                    await self._park(unit, record, f"{UNDECODABLE}{error}", 0, verified)
                    continue
                if delivery is None:
                    continue
                if (suspected := self.suspects.pop(record.offset, None)) is not None:
                    await self._commit(unit, record.offset)  # what came before it, then it alone
                    await self._try_again(record, delivery, suspected, verified)
                    unit = await self.sink.begin()
                    continue
                try:
                    await self._apply(unit, record, delivery)
                except Exception as error:
                    try:
                        await self._commit(unit, record.offset)  # what came before it, without it
                    except (Fenced, *AUTHORIZATION_REFUSED):
                        raise
                    except Exception as lost:
                        raise FailedWithItsUnit(record.offset, error) from lost
                    await self._try_again(record, delivery, error, verified)
                    # `verified` goes on: the parked topic may not show yet what this worker just
                    # parked (a transaction's markers are written after its commit returns).
                    unit = await self.sink.begin()
                    continue
                self._uncounted += 1
            await self._commit(unit, end_offset)
        except BaseException as failure:
            self._uncounted = 0
            await _abort_for(unit, failure)
            raise

    async def _apply(self, unit: Unit, record: ConsumerRecord[bytes, bytes], delivery: Delivery) -> None:
        replaying = record.offset < self.replay_until
        if not self._traced:
            await unit.apply(delivery, replaying)
            return
        if isinstance(delivery, EventDelivery):
            name, handled = delivery.record.type, {"esk.event.type": delivery.record.type}
        else:
            name = f"outcome {delivery.outcome.aggregate_type}.{delivery.outcome.command}"
            handled = {"esk.command.id": delivery.outcome.command_id, "esk.command.outcome": delivery.outcome.status}
        # A child of the context the record carries (the handling of the command that wrote
        # it), and current while the handler runs: the commands a reactor sends carry it on,
        # and whatever the handler itself traces joins the same trace. Each attempt is a span.
        with tracing.TRACER.start_as_current_span(
            f"{self.subscription.name} {name}",
            context=tracing.context_of(record.headers),
            kind=SpanKind.CONSUMER,
            attributes={
                **handled,
                "esk.subscription": self.subscription.name,
                "esk.replaying": replaying,
                "messaging.system": "kafka",
                "messaging.operation.type": "process",
                "messaging.destination.name": record.topic,
                "messaging.destination.partition.id": str(record.partition),
                "messaging.kafka.offset": record.offset,
            },
        ):
            await unit.apply(delivery, replaying)

    async def _check_parked(self, unit: Unit, key: str, offset: int, verified: set[str]) -> Unit:
        """Reads whether the aggregate's events are still parked (a retry or skip from the
        command line may have resolved them since); returns the unit to go on in."""
        parked = self._behind(await unit.parked_of(key))
        verified.add(key)
        if not parked:
            self.parked.discard(key)
            self._not_taken_up.discard(key)
            return unit
        if not (parked[0].reason.startswith(WAITS_BEHIND) and self.sink.resolves_alone) or key in self._not_taken_up:
            return unit
        # A batch of this worker parked them behind an event a retry resolved in the same
        # moment: nothing waits before them now. They are taken up as at an open, in a unit
        # of their own, which locks them as a retry does; what came before goes first.
        await self._commit(unit, offset)
        await self._take_up([key])
        if key in self.parked:  # they failed again, or wait for one now: the next open, or an operator, tries them
            self._not_taken_up.add(key)
        return await self.sink.begin()

    async def _try_again(
        self, record: ConsumerRecord[bytes, bytes], delivery: Delivery, error: Exception, verified: set[str]
    ) -> None:
        """The failed event alone: attempts, each its own unit, then parked (at once for a
        handler's mistake)."""
        retries = self.retries
        attempts = 1
        while attempts < retries.attempts and not isinstance(error, HandlerMistake):
            log.warning(
                "%s: %s at %s/%s/%s failed (attempt %d of %d), trying again in %.1fs: %r",
                self.subscription.name, delivery.source_id, record.topic, record.partition, record.offset,
                attempts, retries.attempts, retries.delay_s(attempts), error,
            )
            SUBSCRIPTION_EVENTS.labels(self.subscription.name, "failed_attempt").inc()
            self.backing_off = True
            try:
                await asyncio.sleep(retries.delay_s(attempts))
            finally:
                self.backing_off = False
            attempts += 1
            unit = await self.sink.begin()
            try:
                await self._apply(unit, record, delivery)
            except Exception as again:
                await _abort_quietly(unit)  # it may have taken its unit with it: the next attempt begins another
                error = again
                continue
            except BaseException as failure:
                await _abort_for(unit, failure)
                raise
            await self._commit(unit, record.offset + 1)
            self._handled.inc()
            return
        unit = await self.sink.begin()
        try:
            await self._park(unit, record, one_line(error), attempts, verified)
        except BaseException as failure:
            await _abort_for(unit, failure)
            raise
        await self._commit(unit, record.offset + 1)

    async def _park(
        self, unit: Unit, record: ConsumerRecord[bytes, bytes], reason: str, attempts: int, verified: set[str]
    ) -> None:
        event = ParkedEvent.of(self.subscription.name, record, reason, attempts, self.router.outcome_of(record))
        event = event.after(await unit.entry_at(record.offset))
        await unit.park(event)
        result = parked_result(reason)
        # A WARNING for what needs someone; INFO for what waits on its own (an event before
        # it, newer code): a rolling release parks thousands so, and metrics count them.
        log.log(
            logging.WARNING if result == "parked" else logging.INFO,
            "%s: parked %s (%s): %s", self.subscription.name, event.position, event.aggregate_id, reason,
        )
        SUBSCRIPTION_EVENTS.labels(self.subscription.name, result).inc()
        self.parked.add(event.aggregate_id)
        verified.add(event.aggregate_id)

    async def _commit(self, unit: Unit, next_offset: int) -> None:
        await unit.commit(next_offset)
        self.next_offset = next_offset
        if self._uncounted:
            self._handled.inc(self._uncounted)
            self._uncounted = 0


async def _abort_for(unit: Unit, failure: BaseException) -> None:
    """`unit` aborted as `failure` goes up. A cancellation (a stop, a revoke) stays one
    whatever the abort meets (its connection gone): replaced by that error, it would be
    taken for a failure to start again from, and the task would not end."""
    if isinstance(failure, Exception):
        await unit.abort()
    else:
        await _abort_quietly(unit)


async def _abort_quietly(unit: Unit) -> None:
    """`unit` aborted, if there is anything left to abort: a handler's failure may have
    taken it with it (its database connection gone)."""
    try:
        await unit.abort()
    except Exception as error:
        log.debug("a unit could not be aborted: %r", error)


async def resolve_parked(
    unit: Unit, router: Router, parked: Sequence[ParkedEvent], status: ParkStatus, by: str
) -> tuple[list[ParkedEvent], list[ParkedEvent]]:
    """An aggregate's parked events, in order, in `unit`: handled again with today's code
    (RETRIED), the first that fails again staying parked and the later ones with it. With
    SKIPPED, the one parked for what it is (its handler failed, it did not decode) is
    dropped, and those parked only to wait behind it are handled again as a retry's are:
    skipping a poison event drops nothing else. Returns those resolved and those still
    parked."""
    resolved: list[ParkedEvent] = []
    still_parked: list[ParkedEvent] = []
    to_skip = status is ParkStatus.SKIPPED
    for event in parked:
        reason = None
        if to_skip and not event.reason.startswith(WAITS_BEHIND):
            to_skip = False
            resolved.append(event.resolved(ParkStatus.SKIPPED, by))
            await unit.park(resolved[-1])
            continue
        if not still_parked:
            reason = await _handle_again(unit, router, event)
        if reason is not None:
            event = event.failed_again(reason, 1)
            await unit.park(event)
        if reason is not None or still_parked:
            still_parked.append(event)
        else:
            resolved.append(event.resolved(ParkStatus.RETRIED, by))
            await unit.park(resolved[-1])
    return resolved, still_parked


async def _handle_again(unit: Unit, router: Router, event: ParkedEvent) -> str | None:
    """None when the event was handled (or is no longer the subscription's); else why it failed."""
    try:
        delivery = _delivery(router, event)
    except Undecodable as error:
        return f"{UNDECODABLE}{error}"
    if delivery is None:
        return None
    try:
        await unit.apply(delivery, False)
    except Exception as error:
        return one_line(error)
    return None


def _decodes(router: Router, event: ParkedEvent) -> bool:
    try:
        _delivery(router, event)
    except Undecodable:
        return False
    return True


def _delivery(router: Router, event: ParkedEvent) -> Delivery | None:
    """The parked event as its handler takes it with today's code; None when the
    subscription no longer handles it. Raises Undecodable."""
    record = event.record()
    route = router.select(record)
    return None if route is None else router.decode(record, route)
