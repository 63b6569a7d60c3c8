"""esk: event sourcing and CQRS on Apache Kafka.

What a user's own code needs is named here, and nothing else is part of the promise:

    from esk import AggregateType, Command, Event, Rejection, given
    from esk import Reactor, DatabaseHandler, SideEffectHandler, Context, Send
    from esk import ReadModel, Projection, Merge, BatchWriter, of, is_event, payload  # (pyspark)

Aggregate types, read models and subscriptions are defined in the user's modules and
registered by settings (`ESK_DOMAIN`, `ESK_READ_MODELS`, `ESK_SUBSCRIPTIONS`); the runtime
behind `esk processor`, `esk api`, `esk subscriber` and `esk dev` finds them there.
"""

from typing import TYPE_CHECKING, Any

from .domain.aggregate import ALREADY_EXISTS, NOT_FOUND, AggregateType, Command, Decision, Event, Rejection
from .domain.testing import given
from .projections.catalog import BatchWriter, Merge, Projection, ReadModel
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

if TYPE_CHECKING:
    from .projections.events import ENVELOPE, ddl, is_event, of, payload

# The read models' column helpers need pyspark, which only the spark extra installs: they
# are imported on first use, so `import esk` works (and stays quick) without it.
_SPARK_HELPERS = frozenset({"ENVELOPE", "ddl", "is_event", "of", "payload"})


def __getattr__(name: str) -> Any:
    if name in _SPARK_HELPERS:
        from .projections import events

        return getattr(events, name)
    raise AttributeError(f"module 'esk' has no attribute {name!r}")


__all__ = [
    "ALREADY_EXISTS",
    "ENVELOPE",
    "NOT_FOUND",
    "AggregateType",
    "AnySubscription",
    "BatchWriter",
    "Command",
    "CommandOutcome",
    "Context",
    "DatabaseContext",
    "DatabaseHandler",
    "Decision",
    "Event",
    "Merge",
    "Origin",
    "OutcomeContext",
    "PostgreSQL",
    "Projection",
    "Reactor",
    "ReadModel",
    "Rejection",
    "Retries",
    "SQLite",
    "Send",
    "SentCommand",
    "SideEffectHandler",
    "Sql",
    "SubscriptionRun",
    "ddl",
    "given",
    "is_event",
    "of",
    "payload",
    "run_subscription",
]
