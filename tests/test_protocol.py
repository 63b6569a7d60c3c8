"""How esk's records are encoded."""

from __future__ import annotations

import tracemalloc

from app.protocol import Outcome, Status


def test_an_encoded_record_takes_about_its_own_size() -> None:
    # orjson returns its whole working buffer (4 KiB); a batch keeps thousands of these
    outcome = Outcome("c-1", "accounts", "acc-1", "deposit", Status.ACCEPTED, 3, processed_at=1)
    size = len(outcome.encode())
    tracemalloc.start()
    try:
        encoded = [outcome.encode() for _ in range(1000)]
        traced, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(encoded) == 1000
    assert traced < 1000 * (size + 200)
