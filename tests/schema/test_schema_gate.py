"""The schema gate: `esk schema lock` and `esk schema check` on small aggregate types built
here, on the example domain against the committed lock file, and end to end on a user
project. No Kafka."""

from __future__ import annotations

import dataclasses
import datetime
import decimal
import enum
import os
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
import pytest
from fastapi import FastAPI
from hypothesis import HealthCheck, given, settings
from pydantic import BaseModel, Field

from esk import AggregateType, Command, Event
from esk.api.openapi import document
from esk.domain.json_schema import model_schema
from esk.registry import Registry, load_registry
from esk.schema.check import Finding, Severity, _holds_all, _json, check
from esk.schema.examples import from_schema
from esk.schema.lock import Lock, LockError, build_lock, dumps, read_lock, write_lock
from esk.settings import Settings

ROOT = Path(__file__).resolve().parents[2]


# -- a small aggregate type, as locked ------------------------------------------------


class Open(Command):
    owner: str = Field(min_length=1, max_length=100)


class Deposit(Command):
    amount: int = Field(gt=0, le=1000)
    note: str | None = None


class Opened(Event):
    owner: str


class Deposited(Event):
    amount: int


class Wallet(BaseModel):
    owner: str
    balance: int = 0


Upcaster = Callable[[dict[str, Any]], dict[str, Any]]


def wallets(
    commands: Mapping[str, type[Command]] | None = None,
    events: Sequence[type[Event]] = (Opened, Deposited),
    state: type[BaseModel] = Wallet,
    upcasters: Mapping[tuple[str, int], Upcaster] | None = None,
) -> Registry:
    """A registry of one aggregate type, `wallets`, as locked unless told otherwise."""
    commands = {"open": Open, "deposit": Deposit} if commands is None else commands
    aggregate: AggregateType[Any] = AggregateType(
        name="wallets",
        state=state,
        commands=commands,
        events=list(events),
        decide=lambda _state, _command: [],
        evolve=lambda state, _event: state,
        creates=frozenset(list(commands.values())[:1]),  # the first makes one (what the lock holds does not depend on it)
        upcasters=upcasters or {},
    )
    return {"wallets": aggregate}


LOCKED = build_lock(wallets())


def of(severity: Severity, findings: list[Finding]) -> list[Finding]:
    return [f for f in findings if f.severity is severity]


def only(severity: Severity, findings: list[Finding]) -> Finding:
    """The one finding of `severity`, when every finding is of it."""
    assert [f.severity for f in findings] == [severity], findings
    return findings[0]


def test_unchanged_code_has_no_findings() -> None:
    assert check(wallets(), LOCKED) == []


# -- events -----------------------------------------------------------------------------


def test_an_event_field_added_without_a_version_bump_is_breaking() -> None:
    class Deposited(Event):
        amount: int
        currency: str

    finding = only(Severity.BREAKING, check(wallets(events=[Opened, Deposited]), LOCKED))
    assert (finding.aggregate, finding.subject, finding.name, finding.path) == ("wallets", "event", "Deposited", "currency")
    assert str(finding) == (
        "wallets event Deposited: new required field `currency`, but schema_version is still 1: "
        "bump it to 2 and add an upcaster from v1"
    )


def test_a_version_bump_with_an_upcaster_passes_and_is_reported() -> None:
    class Deposited(Event):
        schema_version = 2
        amount: int
        currency: str

    registry = wallets(events=[Opened, Deposited], upcasters={("Deposited", 1): lambda d: {**d, "currency": "EUR"}})
    finding = only(Severity.COMPATIBLE, check(registry, LOCKED))
    assert finding.name == "Deposited"
    assert "schema_version 1 -> 2" in str(finding)


def test_a_bounded_decimal_kept_as_it_was_across_a_version_bump_passes() -> None:
    """The payloads drawn for the locked version are ones it accepts: a decimal's digits and
    value are bounded in its JSON Schema on one of its two forms each."""

    def first_release() -> type[Event]:
        class Fuelled(Event):
            liters: decimal.Decimal = Field(max_digits=6, decimal_places=2, gt=0)

        return Fuelled

    class Fuelled(Event):
        schema_version = 2
        liters: decimal.Decimal = Field(max_digits=6, decimal_places=2, gt=0)
        stops: int

    locked = build_lock(wallets(events=[Opened, Deposited, first_release()]))
    registry = wallets(events=[Opened, Deposited, Fuelled], upcasters={("Fuelled", 1): lambda d: {**d, "stops": 0}})
    assert only(Severity.COMPATIBLE, check(registry, locked)).name == "Fuelled"


def test_a_decimal_is_locked_the_same_under_every_pydantic() -> None:
    """Its text's pattern as pydantic wrote it up to 2.13: 2.14 writes none, which would read
    as a change of every locked Decimal, and a narrowed one as no change at all."""

    class Fuelled(Event):
        liters: decimal.Decimal = Field(max_digits=6, decimal_places=2, gt=0)

    locked = build_lock(wallets(events=[Opened, Deposited, Fuelled]))
    liters = locked.aggregates["wallets"].events["Fuelled"].schema["properties"]["liters"]
    assert liters == {
        "anyOf": [
            {"exclusiveMinimum": 0.0, "type": "number"},
            {"pattern": r"^(?!^[-+.]*$)[+-]?0*(?:\d{0,4}|(?=[\d.]{1,7}0*$)\d{0,4}\.\d{0,2}0*$)", "type": "string"},
        ],
        "title": "Liters",
    }


def test_the_http_api_documents_a_decimal_as_the_lock_holds_it() -> None:
    app = FastAPI()
    registry = wallets(commands={"open": Open, "deposit": Priced})
    document(app, Settings(), registry)
    documented = app.openapi()["components"]["schemas"]["wallets.Priced"]["properties"]["price"]
    locked = build_lock(registry).aggregates["wallets"].commands["deposit"]["properties"]["price"]
    assert documented == locked and "pattern" in documented["anyOf"][1], documented


def test_an_upcaster_that_forgets_a_field_is_breaking_and_shows_the_payload() -> None:
    class Deposited(Event):
        schema_version = 2
        amount: int
        currency: str

    registry = wallets(events=[Opened, Deposited], upcasters={("Deposited", 1): lambda d: {**d, "amount": d["amount"] * 100}})
    finding = only(Severity.BREAKING, check(registry, LOCKED))
    assert (finding.name, finding.path) == ("Deposited", "currency")
    assert 'the upcasters turn the v1 payload {"amount": 0} into one the v2 model refuses (field `currency`: Field required)' in str(finding)


def test_a_payload_shown_escapes_what_does_not_print() -> None:
    """A C1 control Hypothesis drew showed as an empty text, for a field of minLength 1."""
    assert _json({"aisle": "\x90", "name": "Zoë", "gap": "\u200b"}) == '{"aisle": "\\u0090", "name": "Zoë", "gap": "\\u200b"}'


def test_the_upcasters_are_run_not_trusted() -> None:
    """Every locked payload has a currency, but only some amounts fit the narrower v2 model."""

    class Deposited(Event):
        schema_version = 2
        amount: int = Field(ge=0, le=500)

    registry = wallets(events=[Opened, Deposited], upcasters={("Deposited", 1): lambda d: d})
    finding = only(Severity.BREAKING, check(registry, LOCKED))
    assert finding.path == "amount"
    assert "field `amount`: Input should be" in str(finding)


def test_an_upcaster_no_stored_event_could_reach_is_refused_at_once() -> None:
    class Deposited(Event):
        schema_version = 2
        amount: int

    with pytest.raises(ValueError, match=r"the upcaster \('Deposited', 2\) would take v2 to v3, but Deposited is v2: .* \(1 to 1\)"):
        wallets(events=[Opened, Deposited], upcasters={("Deposited", 1): lambda d: d, ("Deposited", 2): lambda d: d})
    with pytest.raises(ValueError, match=r"\('Opened', 1\) .* Opened is v1: .* \(none for a v1 event\)"):
        wallets(events=[Opened, Deposited], upcasters={("Deposited", 1): lambda d: d, ("Opened", 1): lambda d: d})
    with pytest.raises(ValueError, match="an upcaster for 'Withdrawn', which is none of its events"):
        wallets(events=[Opened, Deposited], upcasters={("Deposited", 1): lambda d: d, ("Withdrawn", 1): lambda d: d})


def test_an_upcaster_that_raises_is_breaking() -> None:
    class Opened(Event):
        schema_version = 2
        owner: str

    def upcast(data: dict[str, Any]) -> dict[str, Any]:
        return {"owner": data["name"]}  # v1 said `owner` already

    finding = only(Severity.BREAKING, check(wallets(events=[Opened, Deposited], upcasters={("Opened", 1): upcast}), LOCKED))
    assert "the upcaster raised KeyError: 'name'" in str(finding)


def test_a_version_bump_without_an_upcaster_is_breaking() -> None:
    class Deposited(Event):
        schema_version = 2
        amount: int

    finding = only(Severity.BREAKING, check(wallets(events=[Opened, Deposited]), LOCKED))
    assert "no upcaster from v1" in str(finding) and "upcasters[('Deposited', 1)]" in str(finding)


def test_a_version_skipped_by_the_upcasters_is_named() -> None:
    class Deposited(Event):
        schema_version = 3
        amount: int

    finding = only(Severity.BREAKING, check(wallets(events=[Opened, Deposited], upcasters={("Deposited", 1): lambda data: data}), LOCKED))
    assert str(finding).endswith(
        "no upcaster from v2, so stored v1 events could not be brought to v3, a version at a time: add upcasters[('Deposited', 2)]"
    )


def test_a_removed_event_type_is_breaking() -> None:
    finding = only(Severity.BREAKING, check(wallets(events=[Opened]), LOCKED))
    assert (finding.subject, finding.name) == ("event", "Deposited")
    assert "could no longer be read" in str(finding)


def test_a_new_event_type_is_compatible() -> None:
    class Closed(Event):
        pass

    finding = only(Severity.COMPATIBLE, check(wallets(events=[Opened, Deposited, Closed]), LOCKED))
    assert str(finding) == "wallets event Closed: new event type"


def test_a_schema_version_going_back_is_breaking() -> None:
    class Deposited(Event):
        schema_version = 2
        amount: int

    locked = build_lock(wallets(events=[Opened, Deposited], upcasters={("Deposited", 1): lambda d: d}))
    finding = only(Severity.BREAKING, check(wallets(), locked))
    assert "schema_version went back from 2 to 1" in str(finding)


def test_a_rollback_to_a_version_the_lock_holds_as_it_was_does_not_contradict_the_events_stored() -> None:
    """The code of the release before, under the lock of the release that raised a version:
    it writes the older version as that release did, so a processor of it may start (its
    aggregates with newer events unusable meanwhile); an older version of another shape
    would be two shapes under one version, which it may not."""

    class Deposited(Event):
        schema_version = 2
        amount: int
        memo: str = ""

    raised = build_lock(wallets(events=[Opened, Deposited], upcasters={("Deposited", 1): lambda d: d}), LOCKED)
    finding = only(Severity.BREAKING, check(wallets(), raised))
    assert "went back from 2 to 1, its shape as locked before (a rollback)" in str(finding)
    assert not finding.contradicts_stored

    def another_shape() -> type[Event]:
        class Deposited(Event):
            amount: str

        return Deposited

    finding = only(Severity.BREAKING, check(wallets(events=[Opened, another_shape()]), raised))
    assert "went back from 2 to 1: v2 events may be stored already" in str(finding) and finding.contradicts_stored


def test_annotations_and_renamed_nested_models_are_not_shape_changes() -> None:
    class Line(BaseModel):
        sku: str

    class Item(BaseModel):
        """The same shape under another name."""

        sku: str = Field(description="stock keeping unit")

    class Shipped(Event):
        lines: list[Line]

    class Renamed(Event):
        """Documented now."""

        lines: list[Item]

    Renamed.__name__ = "Shipped"  # the event type is its name: the same event type, documented
    locked = build_lock(wallets(events=[Opened, Deposited, Shipped]))
    assert check(wallets(events=[Opened, Deposited, Renamed]), locked) == []


def test_older_versions_stay_locked_and_are_checked_again() -> None:
    class Deposited(Event):
        schema_version = 2
        amount: int
        currency: str

    good = wallets(events=[Opened, Deposited], upcasters={("Deposited", 1): lambda d: {**d, "currency": "EUR"}})
    relocked = build_lock(good, previous=LOCKED)
    assert relocked.aggregates["wallets"].events["Deposited"].older_versions == {1: LOCKED.aggregates["wallets"].events["Deposited"].schema}
    assert check(good, relocked) == []

    broken = wallets(events=[Opened, Deposited], upcasters={("Deposited", 1): lambda d: d})
    finding = only(Severity.BREAKING, check(broken, relocked))
    assert "v1 payload" in str(finding) and finding.path == "currency"


def test_a_locked_schema_no_payloads_can_be_drawn_for_fails_closed() -> None:
    class Unusual(Event):
        amount: int = Field(json_schema_extra={"not": {"const": 13}})

    class Deposited(Event):
        schema_version = 2
        amount: int

    Unusual.__name__ = "Deposited"
    locked = build_lock(wallets(events=[Opened, Unusual]))
    registry = wallets(events=[Opened, Deposited], upcasters={("Deposited", 1): lambda d: d})
    finding = only(Severity.BREAKING, check(registry, locked))
    assert "could not be checked" in str(finding) and "'not'" in str(finding)


# -- commands ---------------------------------------------------------------------------


def test_a_new_required_command_field_is_breaking() -> None:
    class Deposit(Command):
        amount: int = Field(gt=0, le=1000)
        note: str | None = None
        currency: str

    finding = only(Severity.BREAKING, check(wallets(commands={"open": Open, "deposit": Deposit}), LOCKED))
    assert (finding.subject, finding.name, finding.path) == ("command", "deposit", "currency")
    assert str(finding) == "wallets command deposit: new required field `currency`: existing clients do not send it"


def test_a_new_optional_command_field_is_compatible_and_reported() -> None:
    class Deposit(Command):
        amount: int = Field(gt=0, le=1000)
        note: str | None = None
        reference: str | None = None

    finding = only(Severity.COMPATIBLE, check(wallets(commands={"open": Open, "deposit": Deposit}), LOCKED))
    assert str(finding) == "wallets command deposit: new optional field `reference`"


class Lowered(Command):
    amount: int = Field(gt=0, le=100)
    note: str | None = None


class Enumerated(Command):
    amount: int = Field(gt=0, le=1000)
    note: Literal["gift", "salary"] | None = None


class NoteRequired(Command):
    amount: int = Field(gt=0, le=1000)
    note: str


class NoteRemoved(Command):
    amount: int = Field(gt=0, le=1000)


class NotePatterned(Command):
    amount: int = Field(gt=0, le=1000)
    note: str | None = Field(default=None, pattern=r"^[a-z ]*$")


class Priced(Command):
    amount: int = Field(gt=0, le=1000)
    note: str | None = None
    price: decimal.Decimal = Field(default=decimal.Decimal(0), max_digits=6, decimal_places=2)


class PricedFewerDigits(Priced):
    price: decimal.Decimal = Field(default=decimal.Decimal(0), max_digits=4, decimal_places=2)


@pytest.mark.parametrize(
    ("deposit", "path", "words"),
    [
        (Lowered, "amount", "existing clients may send values it refuses"),
        (Enumerated, "note", "existing clients may send values it refuses"),
        (NoteRequired, "note", "is now required"),
        (NoteRemoved, "note", "removed: existing clients that send it are refused"),
        (NotePatterned, "note", "existing clients may send texts its new pattern refuses"),
    ],
    ids=["smaller maximum", "str to Literal", "optional to required", "removed", "a pattern"],
)
def test_a_narrowed_command_is_breaking(deposit: type[Command], path: str, words: str) -> None:
    findings = of(Severity.BREAKING, check(wallets(commands={"open": Open, "deposit": deposit}), LOCKED))
    assert findings and {f.path for f in findings} == {path}, findings
    assert any(words in str(f) for f in findings), findings
    assert all(str(f).startswith(f"wallets command deposit: field `{path}`") for f in findings), findings


def test_a_decimal_with_fewer_digits_is_a_narrowed_command_and_with_more_a_widened_one() -> None:
    locked = build_lock(wallets(commands={"open": Open, "deposit": Priced}))
    narrowed = only(Severity.BREAKING, check(wallets(commands={"open": Open, "deposit": PricedFewerDigits}), locked))
    assert str(narrowed) == (
        "wallets command deposit: field `price`, a Decimal of max_digits 6, decimal_places 2, is one of max_digits 4, "
        "decimal_places 2: existing clients may send values it refuses"
    )
    locked = build_lock(wallets(commands={"open": Open, "deposit": PricedFewerDigits}))
    widened = only(Severity.COMPATIBLE, check(wallets(commands={"open": Open, "deposit": Priced}), locked))
    assert widened.path == "price" and str(widened).endswith("accepting every value it did"), widened


@pytest.mark.parametrize(
    ("before", "after", "holds"),
    [
        ((6, 2), (8, 2), True), ((6, 2), (6, 3), False), ((6, None), (6, 2), False), ((6, 2), (None, 2), True),
        ((None, 2), (6, 2), False), ((None, None), (10, 2), False), ((6, 2), (None, None), True), ((6, 2), (7, 3), True),
    ],
)  # fmt: skip
def test_a_decimal_holds_all_it_did_when_no_bound_of_its_digits_is_lower(
    before: tuple[int | None, int | None], after: tuple[int | None, int | None], holds: bool
) -> None:
    """max_digits, the whole digits it leaves beside decimal_places, and the places (all of
    max_digits when it has no decimal_places)."""
    assert _holds_all(before, after) is holds


def test_a_narrowed_field_of_a_nested_model_is_named() -> None:
    class Line(BaseModel):
        qty: int = Field(gt=0, le=100)

    class Order(Command):
        lines: list[Line]

    class Smaller(BaseModel):
        qty: int = Field(gt=0, le=10)

    class Reorder(Command):
        lines: list[Smaller]

    locked = build_lock(wallets(commands={"order": Order}))
    finding = only(Severity.BREAKING, check(wallets(commands={"order": Reorder}), locked))
    assert finding.path == "lines[].qty"
    assert '{"exclusiveMinimum":0,"maximum":100,"type":"integer"} to {"exclusiveMinimum":0,"maximum":10,"type":"integer"}' in str(finding)


def test_a_widened_command_field_is_compatible() -> None:
    class Deposit(Command):
        amount: int = Field(gt=0, le=10**6)
        note: str | None = None

    finding = only(Severity.COMPATIBLE, check(wallets(commands={"open": Open, "deposit": Deposit}), LOCKED))
    assert finding.path == "amount" and "accepting every value it did" in str(finding)


def test_a_new_command_is_compatible_and_a_removed_one_breaking() -> None:
    class Close(Command):
        pass

    findings = check(wallets(commands={"open": Open, "close": Close}), LOCKED)
    assert [(f.severity, f.name, str(f)) for f in findings] == [
        (Severity.BREAKING, "deposit", "wallets command deposit: removed: existing clients that send it get 404"),
        (Severity.COMPATIBLE, "close", "wallets command close: new command"),
    ]


# -- state and aggregate types ------------------------------------------------------


def test_a_changed_state_is_information_only() -> None:
    class Wallet(BaseModel):
        owner: str
        balance: int = 0
        frozen: bool = False

    finding = only(Severity.INFO, check(wallets(state=Wallet), LOCKED))
    assert str(finding) == "wallets state changed: stored aggregates will be rebuilt from their events (`frozen`)"


def test_a_raised_state_version_is_information_and_locked_only_once_raised() -> None:
    raised = {"wallets": dataclasses.replace(wallets()["wallets"], state_version=2)}
    finding = only(Severity.INFO, check(raised, LOCKED))
    assert str(finding) == "wallets state_version 1 -> 2: stored aggregates will be rebuilt from their events"
    assert check(raised, build_lock(raised)) == []
    # a lock of state_version 1 reads as esk's locks before it held one
    assert "state_version" not in dumps(LOCKED) and '"state_version": 2' in dumps(build_lock(raised))
    assert check(raised, msgspec.json.decode(dumps(build_lock(raised)), type=Lock)) == []


def test_a_removed_aggregate_type_is_breaking_and_a_new_one_compatible() -> None:
    renamed = {"purses": wallets()["wallets"]}
    findings = check(renamed, LOCKED)
    assert [(f.severity, f.aggregate, f.subject) for f in findings] == [
        (Severity.BREAKING, "wallets", "aggregate"),
        (Severity.COMPATIBLE, "purses", "aggregate"),
    ]


# -- the lock file ----------------------------------------------------------------------


def test_the_lock_file_round_trips_with_sorted_keys(tmp_path: Path) -> None:
    path = tmp_path / "esk.lock.json"
    write_lock(LOCKED, path)
    assert read_lock(path) == LOCKED
    text = path.read_text(encoding="utf-8")
    assert text == dumps(build_lock(wallets())), "the same code writes the same file"
    assert text.index('"commands"') < text.index('"events"') < text.index('"state"')


def test_a_missing_or_broken_lock_file_says_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(LockError, match=r"no lock file .*: run `esk schema lock` to write it"):
        read_lock(tmp_path / "esk.lock.json")
    (tmp_path / "esk.lock.json").write_text('{"format": 1}', encoding="utf-8")
    with pytest.raises(LockError, match="is not an esk lock file"):
        read_lock(tmp_path / "esk.lock.json")


# -- the payloads the upcasters are run on --------------------------------------------


class Colour(enum.Enum):
    RED = "red"
    BLUE = "blue"


class Node(BaseModel):
    name: str
    children: list[Node] = []


class Cat(BaseModel):
    kind: Literal["cat"]
    lives: int = Field(ge=0, le=9)


class Dog(BaseModel):
    kind: Literal["dog"]


class Everything(Event):
    at: datetime.datetime
    day: datetime.date
    id: uuid.UUID
    ratio: float = Field(gt=0, lt=1)
    tags: dict[str, int] = Field(default_factory=dict)
    pair: tuple[int, str] | None = None
    colour: Colour = Colour.RED
    code: str = Field(pattern=r"^[A-Z]{3}-\d{2}$")
    short: str = Field(min_length=3, max_length=5)
    tree: Node | None = None
    step: int = Field(multiple_of=5, gt=-12, le=100)
    unique: set[int] = Field(default_factory=set)
    pet: Annotated[Cat | Dog, Field(discriminator="kind")]
    anything: object = None
    # JSON Schema bounds a decimal's string form only (a pattern); its number form too
    price: decimal.Decimal = Field(max_digits=6, decimal_places=2)
    exact: decimal.Decimal = decimal.Decimal(0)
    cents: decimal.Decimal = Field(default=decimal.Decimal(0), max_digits=4, decimal_places=0, ge=-5)


@settings(max_examples=300, derandomize=True, database=None, deadline=None, suppress_health_check=list(HealthCheck))
@given(from_schema(model_schema(Everything)))
def test_generated_payloads_are_valid_for_the_model_they_come_from(payload: dict[str, Any]) -> None:
    """A payload the locked model would refuse would blame an innocent upcaster."""
    Everything.model_validate(payload)


# -- the example domain against the committed lock file ------------------------------


def test_the_example_domain_matches_the_committed_lock_file() -> None:
    """`make test` fails when the example's events or commands change in a way that breaks
    stored events or HTTP clients; after a deliberate change, `esk schema lock` and commit."""
    findings = check(load_registry("domain:AGGREGATES"), read_lock(ROOT / "esk.lock.json"))
    assert of(Severity.BREAKING, findings) == [], "\n".join(map(str, findings))


# -- the command line, end to end ---------------------------------------------------------

V1 = """
    from esk import AggregateType, Command, Event
    from pydantic import BaseModel

    class Open(Command):
        owner: str

    class Opened(Event):
        owner: str

    class Till(BaseModel):
        owner: str

    tills = AggregateType(
        name="tills", state=Till, commands={"open": Open}, creates=frozenset({Open}), events=[Opened],
        decide=lambda state, command: [Opened(owner=command.owner)], evolve=lambda state, event: Till(owner=event.owner),
    )
    AGGREGATES = [tills]
"""


def esk(project: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "ESK_DOMAIN": "shop:AGGREGATES"}
    return subprocess.run([sys.executable, "-m", "esk", "schema", *args], cwd=project, env=env, capture_output=True, text=True, timeout=120)


def write_domain(project: Path, source: str) -> None:
    (project / "shop.py").write_text(textwrap.dedent(source), encoding="utf-8")


def test_the_command_line_locks_and_checks(tmp_path: Path) -> None:
    write_domain(tmp_path, V1)
    missing = esk(tmp_path, "check")
    assert missing.returncode == 1
    assert missing.stderr.strip() == "error: no lock file esk.lock.json: run `esk schema lock` to write it, and commit it"

    locked = esk(tmp_path, "lock")
    assert locked.returncode == 0, locked.stderr
    assert (tmp_path / "esk.lock.json").exists()
    unchanged = esk(tmp_path, "check")
    assert (unchanged.returncode, unchanged.stdout.strip()) == (0, "esk.lock.json: the code matches it")

    # The event changes, and nothing else does: the gate names it.
    write_domain(tmp_path, V1.replace("class Opened(Event):\n        owner: str", "class Opened(Event):\n        owner: str\n        currency: str"))
    changed = esk(tmp_path, "check")
    assert changed.returncode == 1
    assert "tills event Opened: new required field `currency`, but schema_version is still 1" in changed.stdout
    assert changed.stderr.strip() == (
        "error: 1 breaking change against esk.lock.json (it breaks the events stored under it: mend the code, as "
        "`esk schema lock` refuses it)"
    )
    # nor can a new lock take it: the events stored under the old one stay as they are
    before = (tmp_path / "esk.lock.json").read_text()
    refused = esk(tmp_path, "lock")
    assert refused.returncode == 1
    assert "tills event Opened: new required field `currency`, but schema_version is still 1" in refused.stderr
    assert "error: esk.lock.json not written: 1 change breaks the events stored under it (above)" in refused.stderr
    assert (tmp_path / "esk.lock.json").read_text() == before
    # nor does a processor start on it, which would write the new shape under version 1 (esk
    # dev's only warns: tests/packaging/test_user_project.py); refused before it needs a broker
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ESK_", "_ESK_"))}
    processor = subprocess.run(
        [sys.executable, "-m", "esk", "processor"], cwd=tmp_path, capture_output=True, text=True, timeout=60,
        env=env | {"ESK_DOMAIN": "shop:AGGREGATES", "ESK_KAFKA__BOOTSTRAP_SERVERS": "127.0.0.1:9"},
    )
    assert processor.returncode == 1, processor.stderr
    assert "tills event Opened: new required field `currency`, but schema_version is still 1" in processor.stderr
    assert processor.stderr.strip().splitlines()[-1].startswith(
        "error: esk.lock.json: this code would write events under schema versions that stored ones of the same version contradict"
    ), processor.stderr

    # A new schema_version without the upcaster from v1 breaks reading the stored events
    # (`esk schema check` fails on it), but writes none that contradict them: the processor
    # starts (its state rebuild tells the aggregates it cannot read), here to wait for a broker
    write_domain(tmp_path, V1.replace(
        "class Opened(Event):\n        owner: str", "class Opened(Event):\n        schema_version = 2\n        owner: str\n        currency: str"
    ))
    starting = subprocess.Popen(
        [sys.executable, "-m", "esk", "processor"], cwd=tmp_path, stderr=subprocess.PIPE, text=True,
        env=env | {"ESK_DOMAIN": "shop:AGGREGATES", "ESK_KAFKA__BOOTSTRAP_SERVERS": "127.0.0.1:9", "ESK_PROCESSOR__METRICS_PORT": "0"},
    )
    try:
        assert starting.stderr is not None
        assert "no Kafka broker answers at 127.0.0.1:9 yet: waiting for one" in starting.stderr.readline()
    finally:
        starting.kill()
        starting.wait()

    # A new schema_version and an upcaster from v1: the gate passes, and says why.
    write_domain(tmp_path, V1.replace(
        "class Opened(Event):\n        owner: str",
        "class Opened(Event):\n        schema_version = 2\n        owner: str\n        currency: str",
    ).replace("events=[Opened],", 'events=[Opened], upcasters={("Opened", 1): lambda data: {**data, "currency": "EUR"}},'))
    upcast = esk(tmp_path, "check")
    assert upcast.returncode == 0, upcast.stdout + upcast.stderr
    assert "compatible:\n  tills event Opened: schema_version 1 -> 2" in upcast.stdout


def test_a_lock_takes_a_command_change_and_with_force_an_event_change(tmp_path: Path) -> None:
    write_domain(tmp_path, V1)
    assert esk(tmp_path, "lock").returncode == 0
    # a command change that breaks clients is taken by a new lock, as the check says
    write_domain(tmp_path, V1.replace("class Open(Command):\n        owner: str", "class Open(Command):\n        owner: str\n        till: str"))
    checked = esk(tmp_path, "check")
    assert checked.returncode == 1
    assert checked.stderr.strip().endswith("(a command change meant to break clients is accepted by running `esk schema lock`)")
    assert esk(tmp_path, "lock").returncode == 0
    assert esk(tmp_path, "check").stdout.strip() == "esk.lock.json: the code matches it"
    # an event's change under its version only with --force (no such event was ever stored)
    write_domain(tmp_path, V1.replace("class Opened(Event):\n        owner: str", "class Opened(Event):\n        name: str")
                 .replace("Opened(owner=command.owner)", "Opened(name=command.owner)").replace("Till(owner=event.owner)", "Till(owner=event.name)"))
    checked = esk(tmp_path, "check")
    assert checked.stderr.strip().endswith(
        "(2 of them break the events stored under it: mend the code, as `esk schema lock` refuses them)"
    ), checked.stderr
    assert esk(tmp_path, "lock").returncode == 1
    forced = esk(tmp_path, "lock", "--force")
    assert forced.returncode == 0, forced.stderr
    assert esk(tmp_path, "check").stdout.strip() == "esk.lock.json: the code matches it"


def test_a_setting_is_printed_as_it_is(tmp_path: Path) -> None:
    """`:X:` in a setting is no emoji code for esk's errors."""
    write_domain(tmp_path, V1)
    env = {**os.environ, "ESK_DOMAIN": "shop:X:"}
    r = subprocess.run([sys.executable, "-m", "esk", "schema", "check"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "shop:X:" in r.stderr and "\u274c" not in r.stderr, r.stderr


def test_the_command_line_writes_where_it_is_told(tmp_path: Path) -> None:
    write_domain(tmp_path, V1)
    no_folder = esk(tmp_path, "lock", "--file", "schemas/lock.json")
    assert no_folder.returncode == 1
    assert no_folder.stderr.startswith("error: cannot write schemas/lock.json: No such file or directory")
    (tmp_path / "schemas").mkdir()
    assert esk(tmp_path, "lock", "--file", "schemas/lock.json").returncode == 0
    assert esk(tmp_path, "check", "--file", "schemas/lock.json").returncode == 0


def test_the_upcasters_checked_are_the_ones_used() -> None:
    """A mapping changed after the aggregate type was made would skip the check."""

    class Deposited(Event):
        schema_version = 2
        amount: int

    upcasters: dict[tuple[str, int], Upcaster] = {("Deposited", 1): lambda d: d}
    [aggregate] = wallets(events=[Opened, Deposited], upcasters=upcasters).values()
    upcasters[("Opened", 1)] = lambda d: d  # Opened is v1: refused, had it been there at first
    assert list(aggregate.upcasters) == [("Deposited", 1)]
    with pytest.raises(TypeError):
        aggregate.upcasters[("Opened", 1)] = lambda d: d  # type: ignore[index]
