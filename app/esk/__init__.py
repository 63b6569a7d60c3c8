"""esk: event sourcing and CQRS on Apache Kafka.

What a user's own code needs is named here, and nothing else is part of the promise:

    from esk import AggregateType, Command, Event, Rejection, given

Aggregate types, read models and (coming) subscriptions are defined in the user's
modules and registered by settings (`ESK_DOMAIN`, `ESK_READ_MODELS`); the runtime behind
`esk processor`, `esk api` and `esk dev` finds them there.
"""

from .domain.aggregate import ALREADY_EXISTS, NOT_FOUND, AggregateType, Command, Decision, Event, Rejection
from .domain.testing import given

__all__ = ["ALREADY_EXISTS", "NOT_FOUND", "AggregateType", "Command", "Decision", "Event", "Rejection", "given"]
