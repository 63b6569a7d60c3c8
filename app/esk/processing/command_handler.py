"""One command against one aggregate's stored state: the pure core of a StreamTask.

Order of checks: a state the current model can use, expected version (G2), payload,
lifecycle and domain decision. Nothing here touches Kafka or RocksDB, so every rule is
tested without either.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from ..domain.aggregate import AggregateType, Rejection, one_line
from ..protocol import STATE_UNUSABLE, UNKNOWN_COMMAND, CommandEnvelope, EventRecord, Outcome, Status, StoredAggregate

log = logging.getLogger(__name__)


@dataclass(slots=True)  # not frozen: one per command, and a frozen __init__ costs several times more
class HandledCommand:
    outcome: Outcome
    aggregate: StoredAggregate | None  # the new stored state; None when nothing changed
    events: list[EventRecord]


def refusal(
    envelope: CommandEnvelope, status: Status, code: str, detail: str, version: int, now: int
) -> Outcome:
    """The outcome of a command that changed nothing."""
    return Outcome.of(envelope, status, version, processed_at=now, code=code, detail=detail)


def handle_command(
    aggregate_type: AggregateType[Any], envelope: CommandEnvelope, stored: StoredAggregate | None, now: int
) -> HandledCommand:
    current = stored.version if stored is not None else 0

    def refuse(status: Status, code: str, detail: str) -> HandledCommand:
        return HandledCommand(refusal(envelope, status, code, detail, current, now), None, [])

    if stored is not None and (stored.unusable is not None or stored.shape != aggregate_type.state_shape):
        # A start rebuilds every state of an older shape before handling commands; what is
        # left is an aggregate whose events do not fold into the current model.
        reason = stored.unusable or "its state is of an older model and has not been rebuilt"
        return refuse(Status.REJECTED, STATE_UNUSABLE, f"{aggregate_type.name} {envelope.aggregate_id!r} cannot be used: {reason}")
    if envelope.expect_new and stored is not None:
        return refuse(Status.PRECONDITION_FAILED, "precondition_failed", f"exists already at version {current}")
    if envelope.expected_version is not None and envelope.expected_version != current:
        return refuse(
            Status.PRECONDITION_FAILED,
            "precondition_failed",
            f"expected version {envelope.expected_version}, current version is {current}",
        )
    try:
        command = aggregate_type.parse_command(envelope.command, envelope.payload)
    except KeyError:
        return refuse(Status.REJECTED, UNKNOWN_COMMAND, f"{aggregate_type.name} has no command {envelope.command!r}")
    except ValidationError as error:
        # The API refused such a body at once; this one was queued before the command's
        # model changed (a release in between): pydantic's own text runs to lines and links.
        return refuse(Status.REJECTED, "invalid_payload", f"the {envelope.command} payload is invalid: {one_line(error)}")
    try:
        state = aggregate_type.state.model_validate(stored.state) if stored is not None else None
        decision = aggregate_type.handle(state, command, envelope.aggregate_id)
        if isinstance(decision, Rejection):
            return refuse(Status.REJECTED, decision.code, decision.detail)
        new_state = aggregate_type.fold(decision, state)
    except Exception as error:  # a domain bug must not stop the partition (G8)
        log.exception("domain code failed on command %s", envelope.command_id)
        return refuse(Status.REJECTED, "domain_error", f"{type(error).__name__}: {error}")

    correlation_id = envelope.correlation_id or envelope.command_id
    events = [
        EventRecord(
            event_id=f"{envelope.aggregate_type}/{envelope.aggregate_id}/{current + n}",
            aggregate_type=envelope.aggregate_type,
            aggregate_id=envelope.aggregate_id,
            version=current + n,
            type=event.type_name(),
            schema_version=event.schema_version,
            data=event.model_dump(mode="json"),
            command_id=envelope.command_id,
            correlation_id=correlation_id,
            causation_id=envelope.command_id,
            recorded_at=now,
        )
        for n, event in enumerate(decision, start=1)
    ]
    version = current + len(events)
    aggregate = None
    if events and new_state is not None:
        aggregate = StoredAggregate(
            version=version,
            state=new_state.model_dump(mode="json"),
            updated_at=now,
            expires_at=aggregate_type.expires_at(new_state, now),
            shape=aggregate_type.state_shape,
        )
    outcome = Outcome.of(envelope, Status.ACCEPTED, version, processed_at=now, events=[e.public() for e in events])
    return HandledCommand(outcome, aggregate, events)

