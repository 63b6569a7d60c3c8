"""Which subscriptions the application has: the setting `ESK_SUBSCRIPTIONS`
("module:attribute" naming a list of them), imported from the directory esk runs in."""

from __future__ import annotations

from ..registry import by_name, load_object, load_optional
from ..settings import Settings
from .api import AnySubscription, Subscription


def configured_subscriptions(settings: Settings) -> dict[str, AnySubscription]:
    """The application's subscriptions. A project may have none: only when
    ESK_SUBSCRIPTIONS was set is a module that is not there an error."""
    return load_optional(settings.subscriptions, "subscriptions" in settings.model_fields_set, load_subscriptions)


def load_subscriptions(spec: str) -> dict[str, AnySubscription]:
    loaded = by_name(
        load_object(spec, "ESK_SUBSCRIPTIONS"), spec, Subscription,
        "a Reactor, DatabaseHandler or SideEffectHandler", lambda s: s.name, "subscription",
    )
    return dict(loaded)
