"""A processor's start between its wait for Kafka and its first event (pure: the broker's
answers are stood in for): a broker gone while it reads `<app>.schemas` is waited for
again, as at the start, rather than ending the processor with a traceback."""

from __future__ import annotations

import logging

import pytest
from aiokafka.errors import KafkaConnectionError, TopicAuthorizationFailedError

from esk import runtime
from esk.registry import Registry
from esk.settings import Settings


def _answers(monkeypatch: pytest.MonkeyPatch, *failures: Exception) -> list[str]:
    """`hold_to_recorded_schemas` failing with `failures` in turn, then holding; the calls."""
    calls: list[str] = []
    left = list(failures)

    async def hold(settings: Settings, registry: Registry, refuse: bool) -> None:
        calls.append("hold")
        if left:
            raise left.pop(0)

    monkeypatch.setattr(runtime, "hold_to_recorded_schemas", hold)
    return calls


def test_a_broker_gone_while_the_recorded_schemas_are_read_is_waited_for_again(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    calls = _answers(monkeypatch, KafkaConnectionError("Unable to bootstrap from [('127.0.0.1', 9092)]"), ConnectionRefusedError(111, "refused"))
    with caplog.at_level(logging.WARNING, logger="esk.runtime"):
        runtime._hold_to_recorded_schemas(Settings(app="shop"), {}, lambda: calls.append("wait"))
    assert calls == ["hold", "wait", "hold", "wait", "hold"]
    told = [r.getMessage() for r in caplog.records]
    assert len(told) == 2 and all(m.startswith("the recorded schemas could not be read (") for m in told), told
    assert "waiting for Kafka again" in told[0] and "Unable to bootstrap" in told[0]


def test_a_refusal_that_waiting_does_not_mend_ends_the_start(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _answers(monkeypatch, TopicAuthorizationFailedError())
    with pytest.raises(TopicAuthorizationFailedError):
        runtime._hold_to_recorded_schemas(Settings(app="shop"), {}, lambda: calls.append("wait"))
    assert calls == ["hold"]
