"""The embedded single-node Apache Kafka broker (KRaft) behind `esk broker`."""

from .embedded import BrokerError, EmbeddedBroker

__all__ = ["BrokerError", "EmbeddedBroker"]
