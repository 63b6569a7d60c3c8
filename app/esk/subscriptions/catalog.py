"""Which subscriptions the application has: the setting `ESK_SUBSCRIPTIONS`
("module:attribute" naming a list of them), imported from the directory esk runs in."""

from __future__ import annotations

from ..registry import ModuleMissing, load_object
from ..settings import Settings
from .api import AnySubscription, Subscription


def configured_subscriptions(settings: Settings) -> dict[str, AnySubscription]:
    """The application's subscriptions. A project may have none: only when
    ESK_SUBSCRIPTIONS was set is a module that is not there an error."""
    try:
        return load_subscriptions(settings.subscriptions)
    except ModuleMissing:
        if "subscriptions" in settings.model_fields_set:
            raise
        return {}


def load_subscriptions(spec: str) -> dict[str, AnySubscription]:
    found: dict[str, AnySubscription] = {}
    for subscription in load_object(spec, "ESK_SUBSCRIPTIONS"):
        if not isinstance(subscription, Subscription):
            raise TypeError(f"{spec} holds {subscription!r}, not a Reactor, DatabaseHandler or SideEffectHandler")
        if subscription.name in found:
            raise ValueError(f"subscription {subscription.name!r} is registered twice")
        found[subscription.name] = subscription
    return found
