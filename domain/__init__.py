"""The example domain of docs/product.md (a bank and a shop), written as any user's own domain
is: with `import esk` alone. The default `ESK_DOMAIN` (`domain:AGGREGATES`) finds it when
esk runs from this directory."""

from esk import AggregateType

from .accounts import accounts
from .orders import orders

AGGREGATES: list[AggregateType] = [accounts, orders]  # type: ignore[type-arg]  # a list of types with different states
