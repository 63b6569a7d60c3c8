"""The example domains of PRODUCT.md; the default `ESK_DOMAIN` points here."""

from domain.accounts import accounts
from domain.aggregate import AggregateType
from domain.orders import orders

AGGREGATES: list[AggregateType] = [accounts, orders]  # type: ignore[type-arg]
