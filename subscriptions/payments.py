"""The `payments` saga: an order placed with `pay_from` is paid from that account, or
cancelled when the account cannot pay (insufficient funds, unknown or closed account).

Every command it sends has an id derived from what it was handling, so an order is never
paid twice, however often the saga handles its Placed event again; and it cancels only an
order whose payment was refused, so no order is both paid and cancelled.
"""

from __future__ import annotations

from domain.accounts import Withdraw, accounts
from domain.orders import Cancel, Placed, orders
from esk import CommandOutcome, Context, OutcomeContext, Reactor, Send

payments = Reactor("payments", reads=[orders])


@payments.on(Placed)
async def pay(event: Placed, ctx: Context) -> list[Send]:
    if event.pay_from is None or event.total == 0:
        return []
    return [Send(accounts, event.pay_from, Withdraw(amount=event.total))]


@payments.on_outcome(Withdraw)
async def paid_or_not(outcome: CommandOutcome, ctx: OutcomeContext) -> list[Send]:
    if outcome.accepted or outcome.origin is None:
        return []
    return [Send(orders, outcome.origin.aggregate_id, Cancel())]
