"""Pure domain code: aggregates as pydantic models and two functions. Imports nothing from app/."""

from domain.aggregate import (
    ALREADY_EXISTS,
    NOT_FOUND,
    AggregateType,
    Command,
    Decision,
    Event,
    Rejection,
)

__all__ = ["ALREADY_EXISTS", "NOT_FOUND", "AggregateType", "Command", "Decision", "Event", "Rejection"]
