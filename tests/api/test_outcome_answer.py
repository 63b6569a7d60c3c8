"""A command's answer shows its events as this release's schemas have them: an outcome
stored by an older release (a retry answered after an upgrade, or by an API released before
the processor) holds them as that release wrote them."""

from __future__ import annotations

import logging

import orjson
import pytest

from domain.accounts import accounts
from esk.api.commands import outcome_response, outcome_status
from esk.protocol import Outcome, Status

# As the processor of the release before wrote it: Opened v1 called the owner "name".
STORED = Outcome(
    "open-1", "accounts", "a1", "open", Status.ACCEPTED, 2,
    events=[
        {"event_id": "accounts/a1/1", "type": "Opened", "version": 1, "schema_version": 1, "data": {"name": "ada"}, "recorded_at": 1},
        {"event_id": "accounts/a1/2", "type": "Deposited", "version": 2, "schema_version": 1, "data": {"amount": 5}, "recorded_at": 1},
    ],
)  # fmt: skip


def test_an_older_releases_events_are_answered_in_todays_schema() -> None:
    answer = orjson.loads(outcome_response(STORED, accounts).body)
    assert [(e["type"], e["schema_version"], e["data"]) for e in answer["events"]] == [
        ("Opened", 2, {"owner": "ada"}), ("Deposited", 1, {"amount": 5}),
    ]
    assert STORED.events[0]["data"] == {"name": "ada"}  # the stored outcome is left as it is


def test_an_event_the_upcasters_cannot_bring_up_is_answered_as_stored(caplog: pytest.LogCaptureFixture) -> None:
    odd = Outcome("open-2", "accounts", "a2", "open", Status.ACCEPTED, 1, events=[{**STORED.events[0], "data": {"nom": "ada"}}])
    answer = orjson.loads(outcome_response(odd, accounts).body)
    assert [(e["schema_version"], e["data"]) for e in answer["events"]] == [(1, {"nom": "ada"})]
    assert "the outcome of command 'open-2': Opened v1 shown as stored" in caplog.text
    assert caplog.records[-1].levelno == logging.WARNING


def test_an_event_type_of_newer_code_is_answered_as_written_and_not_warned_of(caplog: pytest.LogCaptureFixture) -> None:
    """An API released after the processor, for a while: each answer would warn."""
    newer = Outcome("close-1", "accounts", "a3", "close", Status.ACCEPTED, 2, events=[{**STORED.events[0], "type": "Frozen", "data": {"x": 1}}])
    answer = orjson.loads(outcome_response(newer, accounts).body)
    assert [(e["type"], e["schema_version"], e["data"]) for e in answer["events"]] == [("Frozen", 1, {"x": 1})]
    assert "shown as stored" not in caplog.text


@pytest.mark.parametrize(
    ("status", "code", "http"),
    [(Status.ACCEPTED, None, 200), (Status.PRECONDITION_FAILED, "version_mismatch", 412), (Status.REJECTED, "not_found", 404),
     (Status.REJECTED, "already_exists", 409), (Status.REJECTED, "state_unusable", 500), (Status.REJECTED, "insufficient_funds", 422),
     # the processor's, for a command queued before a release took its name or type away: the API's own 404s
     (Status.REJECTED, "unknown_command", 404), (Status.REJECTED, "unknown_aggregate_type", 404)],
)  # fmt: skip
def test_the_answers_status_is_the_one_get_commands_tells(status: Status, code: str | None, http: int) -> None:
    outcome = Outcome("c", "accounts", "a1", "withdraw", status, 1, code=code)
    assert outcome_status(outcome) == http == outcome_response(outcome, accounts).status_code
