"""Which Kafka errors are worth waiting out: one helper for every process that waits for
brokers (the API's commands, the admin requests, the processor's start), so that each
tells a broker away from a request refused alike."""

from __future__ import annotations

from aiokafka.errors import KafkaError, KafkaTimeoutError


def broker_away(error: BaseException) -> bool:
    """The error says no broker answered as needed (none in time, no leader, no metadata, a
    connection refused), which a broker coming back or another taking over ends; not that
    the request itself was refused, which asking again would not change."""
    if isinstance(error, KafkaTimeoutError | OSError):  # TimeoutError is an OSError
        return True
    return isinstance(error, KafkaError) and bool(error.retriable)
