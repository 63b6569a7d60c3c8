"""esk: event sourcing and CQRS on Apache Kafka.

What a user's own code needs is named here, and nothing else is part of the promise:

    from esk import AggregateType, Command, Event, Rejection, given
    from esk import Reactor, DatabaseHandler, SideEffectHandler, Context, Send

Aggregate types, read models and subscriptions are defined in the user's modules and
registered by settings (`ESK_DOMAIN`, `ESK_READ_MODELS`, `ESK_SUBSCRIPTIONS`); the runtime
behind `esk processor`, `esk api`, `esk subscriber` and `esk dev` finds them there.
"""

from .domain.aggregate import ALREADY_EXISTS, NOT_FOUND, AggregateType, Command, Decision, Event, Rejection
from .domain.testing import given
from .subscriptions.api import (
    AnySubscription,
    CommandOutcome,
    Context,
    DatabaseContext,
    DatabaseHandler,
    Origin,
    OutcomeContext,
    Reactor,
    Retries,
    Send,
    SideEffectHandler,
)
from .subscriptions.database import Sql, SQLite
from .subscriptions.postgres import PostgreSQL
from .subscriptions.testing import SentCommand, SubscriptionRun, run_subscription

__all__ = [
    "ALREADY_EXISTS",
    "NOT_FOUND",
    "AggregateType",
    "AnySubscription",
    "Command",
    "CommandOutcome",
    "Context",
    "DatabaseContext",
    "DatabaseHandler",
    "Decision",
    "Event",
    "Origin",
    "OutcomeContext",
    "PostgreSQL",
    "Reactor",
    "Rejection",
    "Retries",
    "SQLite",
    "Send",
    "SentCommand",
    "SideEffectHandler",
    "Sql",
    "SubscriptionRun",
    "given",
    "run_subscription",
]
