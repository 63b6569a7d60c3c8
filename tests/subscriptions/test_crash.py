"""The short variant of the subscriptions' crash harness (`make subscriptions-crash` runs 30
kills): real processes, real SIGKILLs of the `customer_ledger` and `payments` subscribers
under load from the API, against the suite's broker."""

from __future__ import annotations

from pathlib import Path

import pytest
from rich.console import Console

from bench import subscriptions_crash
from esk.settings import Settings

pytestmark = pytest.mark.kafka


async def test_sigkilled_subscribers_apply_every_event_once(settings: Settings, tmp_path: Path) -> None:
    verdict = await subscriptions_crash.run(
        settings, tmp_path / "crash", kills=3, rate=40, min_gap_s=5.0, max_gap_s=9.0, seed=5, console=Console()
    )
    print(verdict.notes)
    assert verdict.orders_with_pay_from > 20 and verdict.paid > 0 and verdict.cancelled > 0
    assert verdict.subscriber_starts >= 2 + 3
    # the ledger matches the events; each paid-from order paid once or cancelled once; no
    # saga command twice on the commands topic; balances add up; nothing parked
    assert verdict.ok, vars(verdict)
