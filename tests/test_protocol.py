"""How esk's records are encoded."""

from __future__ import annotations

import tracemalloc

import msgspec
import orjson
import pytest

from esk.protocol import CommandEnvelope, DecodeError, EventRecord, Outcome, Status, StoredAggregate, payload_digest


def test_an_encoded_record_takes_about_its_own_size() -> None:
    # a batch keeps thousands of these until its commit
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


ENVELOPE = CommandEnvelope("c-1", "accounts", "acc-1", "deposit", {"amount": 5}, 2, False, "corr", "cause", 7)
EVENT = EventRecord("accounts/acc-1/3", "accounts", "acc-1", 3, "Deposited", 1, {"amount": 5}, "c-1", "corr", "c-1", 13)
RECORDS = [
    ENVELOPE,
    Outcome("c-1", "accounts", "acc-1", "deposit", Status.REJECTED, 2, [{"type": "X"}], "code", "detail", 9),
    StoredAggregate(3, {"balance": 5}, 11, 12),
    EVENT,
]


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: type(r).__name__)
def test_a_record_is_encoded_with_every_field_and_decodes_to_itself(record: msgspec.Struct) -> None:
    encoded = record.encode()  # type: ignore[attr-defined]
    assert list(orjson.loads(encoded)) == [f.name for f in msgspec.structs.fields(record)]
    assert type(record).decode(encoded) == record  # type: ignore[attr-defined]


# Written by the orjson-based records that came before (the same fields, in the same order):
# what is on the topics and in the stores already must still decode, to the same bytes.
OLD_FORMAT = [
    (
        b'{"command_id":"c-1","aggregate_type":"accounts","aggregate_id":"acc-1","command":"deposit",'
        b'"payload":{"amount":5,"note":"caf\xc3\xa9","rate":0.1},"expected_version":2,"expect_new":false,'
        b'"correlation_id":"corr","causation_id":null,"submitted_at":7}',
        CommandEnvelope("c-1", "accounts", "acc-1", "deposit", {"amount": 5, "note": "café", "rate": 0.1}, 2, False, "corr", None, 7),
    ),
    (
        b'{"command_id":"c-1","aggregate_type":"accounts","aggregate_id":"acc-1","command":"deposit",'
        b'"status":"accepted","version":3,"events":[{"event_id":"accounts/acc-1/3","type":"Deposited",'
        b'"version":3,"schema_version":1,"data":{"amount":5},"recorded_at":9}],"code":null,"detail":null,'
        b'"processed_at":9}',
        Outcome(
            "c-1", "accounts", "acc-1", "deposit", Status.ACCEPTED, 3,
            [{"event_id": "accounts/acc-1/3", "type": "Deposited", "version": 3, "schema_version": 1, "data": {"amount": 5}, "recorded_at": 9}],
            None, None, 9,
        ),
    ),
    (
        b'{"version":3,"state":{"owner":"ada","balance":5,"status":"open"},"updated_at":11,"expires_at":null}',
        StoredAggregate(3, {"owner": "ada", "balance": 5, "status": "open"}, 11, None),
    ),
    (
        b'{"event_id":"accounts/acc-1/3","aggregate_type":"accounts","aggregate_id":"acc-1","version":3,'
        b'"type":"Deposited","schema_version":1,"data":{"amount":5},"command_id":"c-1","correlation_id":"corr",'
        b'"causation_id":"c-1","recorded_at":13}',
        EVENT,
    ),
]


@pytest.mark.parametrize(("raw", "record"), OLD_FORMAT, ids=lambda x: type(x).__name__)
def test_a_record_written_before_msgspec_decodes_and_encodes_the_same(raw: bytes, record: msgspec.Struct) -> None:
    decoded = type(record).decode(raw)  # type: ignore[attr-defined]
    assert decoded == record
    # records that have gained fields since: the old ones keep their bytes
    gained = {StoredAggregate: b',"shape":null,"unusable":null}', Outcome: b',"payload_digest":null}'}.get(type(record))
    assert decoded.encode() == (raw if gained is None else raw[:-1] + gained)


def test_a_field_with_a_default_may_be_missing() -> None:
    assert StoredAggregate.decode(b'{"version":3,"state":{},"updated_at":11}') == StoredAggregate(3, {}, 11, None)
    outcome = Outcome.decode(b'{"command_id":"c","aggregate_type":"t","aggregate_id":"i","command":"x","status":"rejected","version":0}')
    assert (outcome.status, outcome.events, outcome.code) == (Status.REJECTED, [], None)


def test_an_outcome_keeps_a_digest_of_its_command_s_payload_whatever_the_order_of_its_keys() -> None:
    lines = [{"sku": "a", "qty": 1}, {"sku": "b", "qty": 2}]
    digest = payload_digest({"customer_id": "c1", "lines": lines})
    assert digest == payload_digest(orjson.loads(b'{"lines":[{"qty":1,"sku":"a"},{"qty":2,"sku":"b"}],"customer_id":"c1"}'))
    for other in ({"customer_id": "c1", "lines": lines[::-1]}, {"customer_id": "c2", "lines": lines}, {"customer_id": "c1"}):
        assert payload_digest(other) != digest
    assert payload_digest({"amount": 5}) != payload_digest({"amount": 5.5}) != payload_digest({"amount": "5"})


def _envelope_with(drop: str = "", **changes: object) -> bytes:
    fields = {name: value for name, value in orjson.loads(ENVELOPE.encode()).items() if name != drop}
    return orjson.dumps(fields | changes)


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (None, "empty record"),
        (b"", "not JSON"),
        (b"\xff not json", "not JSON"),
        (b'{"command_id": "c-1"', "not JSON"),
        (b"[1, 2]", "Expected `object`, got `array`"),
        (b'"c-1"', "Expected `object`, got `str`"),
        *[(_envelope_with(drop=name), f"missing required field `{name}`") for name in ("command_id", "aggregate_type", "aggregate_id", "command")],
        *[(_envelope_with(**{name: ""}), f"length >= 1 - at `$.{name}`") for name in ("command_id", "aggregate_type", "aggregate_id", "command")],
        (_envelope_with(command_id=5), "Expected `str`, got `int` - at `$.command_id`"),
        (_envelope_with(payload=[1]), "got `array` - at `$.payload`"),
        (_envelope_with(payload="x"), "got `str` - at `$.payload`"),
        (_envelope_with(expected_version=True), "got `bool` - at `$.expected_version`"),
        (_envelope_with(expected_version="2"), "got `str` - at `$.expected_version`"),
        (_envelope_with(expected_version=2.5), "got `float` - at `$.expected_version`"),
        (_envelope_with(unknown=1), "unknown field `unknown`"),
    ],
)
def test_a_record_that_is_not_a_command_envelope_is_a_decode_error_that_says_why(raw: bytes | None, reason: str) -> None:
    with pytest.raises(DecodeError) as error:
        CommandEnvelope.decode(raw)
    assert reason in str(error.value)
    if raw and raw.startswith(b"{") and raw.endswith(b"}"):
        assert str(error.value).startswith("not a CommandEnvelope: ")


def test_an_expected_version_may_be_null_or_an_integer() -> None:
    assert CommandEnvelope.decode(_envelope_with(expected_version=None)).expected_version is None
    assert CommandEnvelope.decode(_envelope_with(expected_version=0)).expected_version == 0


def test_other_records_fail_with_a_decode_error_too() -> None:
    with pytest.raises(DecodeError, match="not JSON"):
        StoredAggregate.decode(b"nope")
    with pytest.raises(DecodeError, match="Invalid enum value 'maybe'"):
        Outcome.decode(b'{"command_id":"c","aggregate_type":"t","aggregate_id":"i","command":"x","status":"maybe","version":0}')


def test_records_are_values() -> None:
    with pytest.raises(AttributeError):
        ENVELOPE.command = "withdraw"  # type: ignore[misc]


def test_the_public_event_is_the_fields_public_names_in_that_order() -> None:
    public = EVENT.public()
    assert list(public) == list(EventRecord.PUBLIC)
    assert public == {name: getattr(EVENT, name) for name in EventRecord.PUBLIC}
    assert set(EventRecord.PUBLIC) <= set(EventRecord.__struct_fields__)


def test_event_headers() -> None:
    assert EVENT.headers() == [
        ("esk-event-type", b"Deposited"),
        ("esk-schema-version", b"1"),
        ("esk-command-id", b"c-1"),
        ("esk-correlation-id", b"corr"),
        ("esk-causation-id", b"c-1"),
    ]


def test_an_outcome_carries_its_commands_identity() -> None:
    outcome = Outcome.of(ENVELOPE, Status.ACCEPTED, 3, processed_at=9, events=[EVENT.public()])
    assert outcome == Outcome(
        "c-1", "accounts", "acc-1", "deposit", Status.ACCEPTED, 3, [EVENT.public()], None, None, 9, payload_digest(ENVELOPE.payload)
    )
    refused = Outcome.of(ENVELOPE, Status.REJECTED, 2, processed_at=9, code="c", detail="d")
    assert (refused.command_id, refused.events, refused.code, refused.detail) == ("c-1", [], "c", "d")


def test_the_key_is_the_aggregate_id() -> None:
    assert ENVELOPE.key == b"acc-1"


def test_the_spark_envelope_and_the_archive_have_the_event_records_fields() -> None:
    pytest.importorskip("pyspark")
    from esk.projections.events import ENVELOPE as SPARK_ENVELOPE
    from esk.projections.events import ddl

    names = list(EventRecord.__struct_fields__)
    assert SPARK_ENVELOPE.fieldNames() == names
    assert ddl(SPARK_ENVELOPE).split(", ")[names.index("data")] == "data string"
    assert ddl(SPARK_ENVELOPE).split(", ")[names.index("schema_version")] == "schema_version int"
