"""How esk's records are encoded."""

from __future__ import annotations

import dataclasses
import tracemalloc

import orjson
import pytest

from esk.protocol import CommandEnvelope, EventRecord, Outcome, Status, StoredAggregate


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


RECORDS = [
    CommandEnvelope("c-1", "accounts", "acc-1", "deposit", {"amount": 5}, 2, False, "corr", "cause", 7),
    Outcome("c-1", "accounts", "acc-1", "deposit", Status.REJECTED, 2, [{"type": "X"}], "code", "detail", 9),
    StoredAggregate(3, {"balance": 5}, 11, 12),
    EventRecord("accounts/acc-1/3", "accounts", "acc-1", 3, "Deposited", 1, {"amount": 5}, "c-1", "corr", "c-1", 13),
]


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: type(r).__name__)
def test_a_record_is_encoded_with_every_field_and_decodes_to_itself(record: object) -> None:
    encoded = record.encode()  # type: ignore[attr-defined]
    assert set(orjson.loads(encoded)) == {f.name for f in dataclasses.fields(record)}  # type: ignore[arg-type]
    assert type(record).decode(encoded) == record  # type: ignore[attr-defined]
