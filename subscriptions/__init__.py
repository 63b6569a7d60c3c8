"""The example application's subscriptions, written as any user's are, with `import esk`
alone. The default `ESK_SUBSCRIPTIONS` (`subscriptions:SUBSCRIPTIONS`) finds them when esk
runs from this directory; `esk subscriber NAME` runs one, `esk dev` all of them."""

from esk import AnySubscription

from .customer_ledger import customer_ledger
from .payments import payments

SUBSCRIPTIONS: list[AnySubscription] = [payments, customer_ledger]
