"""Which Kafka errors the processes wait out (esk.kafka.errors.broker_away): pure logic."""

from __future__ import annotations

import pytest
from aiokafka.errors import (
    KafkaConnectionError,
    KafkaTimeoutError,
    MessageSizeTooLargeError,
    NodeNotReadyError,
    NotEnoughReplicasError,
    NotLeaderForPartitionError,
    OutOfOrderSequenceNumber,
    RequestTimedOutError,
    TopicAuthorizationFailedError,
)

from esk.kafka.errors import broker_away


@pytest.mark.parametrize(
    "error",
    [
        TimeoutError(),  # asyncio.wait_for's, as Python 3.11 raises it
        KafkaTimeoutError(),  # aiokafka's own, which it does not mark retriable
        ConnectionRefusedError(),
        KafkaConnectionError(),
        NodeNotReadyError(),
        NotLeaderForPartitionError(),
        RequestTimedOutError(),
        NotEnoughReplicasError(),  # below min.insync.replicas: brokers coming back end it
    ],
    ids=lambda error: type(error).__name__,
)
def test_a_broker_away_is_waited_out(error: BaseException) -> None:
    assert broker_away(error)


@pytest.mark.parametrize(
    "error",
    [TopicAuthorizationFailedError(), MessageSizeTooLargeError(), OutOfOrderSequenceNumber(), ValueError("a bug")],
    ids=lambda error: type(error).__name__,
)
def test_a_refused_request_or_a_bug_is_not(error: BaseException) -> None:
    assert not broker_away(error)
