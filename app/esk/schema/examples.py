"""Payloads valid under a JSON Schema, as a Hypothesis strategy: what the upcaster check feeds
the upcasters.

Hypothesis rather than a random generator: its numbers and strings lean to the edges (0,
negatives, the bounds, empty strings), a failure shrinks to the smallest payload that shows
it, and a derandomized run gives CI the same verdict every time. hypothesis-jsonschema would
be the library for this, but it no longer runs on current Hypothesis, so this covers the
JSON Schema pydantic writes; a keyword outside it raises `Unsupported` rather than guess.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from decimal import Decimal
from typing import Any

from hypothesis import strategies as st

from ..domain.json_schema import DECIMAL_PATTERN_START
from .diff import ANNOTATIONS, resolve

Schema = Mapping[str, Any]
Strategy = st.SearchStrategy[Any]

# Keywords that do not restrict a value (pydantic writes these beside the ones that do).
_IGNORED = ANNOTATIONS | {"default", "deprecated", "readOnly", "writeOnly", "discriminator", "$defs", "definitions", "$schema", "$id"}
_KNOWN = frozenset({
    "type", "enum", "const", "anyOf", "oneOf", "allOf", "$ref",
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
    "minLength", "maxLength", "pattern", "format",
    "items", "prefixItems", "minItems", "maxItems", "uniqueItems",
    "properties", "required", "additionalProperties", "patternProperties", "propertyNames", "minProperties", "maxProperties",
})  # fmt: skip
_FORMATS: dict[str, Strategy] = {
    "date-time": st.datetimes().map(lambda d: d.isoformat()),
    "date": st.dates().map(lambda d: d.isoformat()),
    "time": st.times().map(lambda t: t.isoformat()),
    "uuid": st.uuids().map(str),
    "email": st.emails(),
    "ipv4": st.ip_addresses(v=4).map(str),
    "ipv6": st.ip_addresses(v=6).map(str),
    "uri": st.from_regex(r"\Ahttps?://[a-z][a-z0-9-]{0,20}(\.[a-z]{2,6}){1,2}(/[A-Za-z0-9._~-]{0,10}){0,3}\Z"),
}
_JSON_SCALARS = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text()
_ANY_JSON = st.recursive(_JSON_SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3), max_leaves=6)


class Unsupported(ValueError):
    """The schema uses a keyword (or format) this generator does not cover."""


def from_schema(schema: Schema) -> Strategy:
    """Values valid under `schema`, whose local `$ref`s point into `schema` itself."""
    return _Builder(schema).build(schema)


class _Builder:
    def __init__(self, root: Schema) -> None:
        self.root = root
        # One deferred strategy per reference, built once: recursive models refer to themselves.
        self.references: dict[str, Strategy] = {}

    def build(self, schema: Schema | bool) -> Strategy:
        if schema is True:
            return _ANY_JSON
        if schema is False:
            return st.nothing()
        reference = schema.get("$ref")
        if isinstance(reference, str):
            return self._reference(schema, reference)
        unknown = schema.keys() - _KNOWN - _IGNORED
        if unknown:
            raise Unsupported(f"JSON Schema keyword {sorted(unknown)[0]!r}")
        if "allOf" in schema:
            return self.build(_merged(schema))
        if "anyOf" in schema or "oneOf" in schema:
            # pydantic's oneOf is a discriminated union, whose branches never overlap.
            rest = {k: v for k, v in schema.items() if k not in ("anyOf", "oneOf")}
            branches = [{**rest, **branch} for branch in schema.get("anyOf", schema.get("oneOf", []))]
            if (decimal := _decimal_forms(branches)) is not None:
                return _decimals(*decimal)
            return st.one_of([self.build(branch) for branch in branches])
        if "const" in schema:
            return st.just(schema["const"])
        if "enum" in schema:
            return st.sampled_from(schema["enum"])
        types = schema.get("type")
        if types is None:
            return _ANY_JSON
        if isinstance(types, list):
            return st.one_of([self.build({**schema, "type": t}) for t in types])
        return self._typed(types, schema)

    def _reference(self, schema: Schema, reference: str) -> Strategy:
        siblings = {k: v for k, v in schema.items() if k != "$ref" and k not in _IGNORED}
        if siblings:  # a field's own constraints beside the model it refers to
            resolved, _ = resolve(schema, self.root)
            return self.build(resolved)
        if reference not in self.references:
            target, _ = resolve({"$ref": reference}, self.root)
            if "$ref" in target:
                raise Unsupported(f"reference {reference!r} outside the schema")
            self.references[reference] = st.deferred(lambda: self.build(target))
        return self.references[reference]

    def _typed(self, kind: str, schema: Schema) -> Strategy:
        if kind == "null":
            return st.none()
        if kind == "boolean":
            return st.booleans()
        if kind == "integer":
            return _integers(schema)
        if kind == "number":
            # A multiple of a whole step is an integer; of any other, not something drawn here.
            return _integers(schema) if "multipleOf" in schema else _integers(schema) | _floats(schema)
        if kind == "string":
            return _strings(schema)
        if kind == "array":
            return self._array(schema)
        if kind == "object":
            return self._object(schema)
        raise Unsupported(f"JSON Schema type {kind!r}")

    def _array(self, schema: Schema) -> Strategy:
        prefix = [self.build(item) for item in schema.get("prefixItems", [])]
        # Without `items`, a tuple's length is its prefix's (pydantic bounds it anyway).
        items = schema.get("items", not prefix)
        rest_low = max(0, schema.get("minItems", 0) - len(prefix))
        rest_high = rest_low + 5 if "maxItems" not in schema else max(0, schema["maxItems"] - len(prefix))
        unique = schema.get("uniqueItems", False)
        rest = st.lists(self.build(items), min_size=rest_low, max_size=rest_high, unique_by=_key if unique else None)
        if not prefix:
            return rest
        return st.tuples(st.tuples(*prefix), rest).map(lambda parts: [*parts[0], *parts[1]]).filter(lambda v: not unique or len({_key(x) for x in v}) == len(v))

    def _object(self, schema: Schema) -> Strategy:
        properties: Mapping[str, Any] = schema.get("properties", {})
        required = set(schema.get("required", ()))
        fixed = st.fixed_dictionaries(
            {name: self.build(sub) for name, sub in properties.items() if name in required},
            optional={name: self.build(sub) for name, sub in properties.items() if name not in required},
        )
        extra_values = schema.get("additionalProperties")
        patterns: Mapping[str, Any] = schema.get("patternProperties", {})
        if not isinstance(extra_values, Mapping) and not patterns:
            # Extra keys are allowed unless forbidden, but a model never writes them.
            return _sized(fixed, schema)
        names = self._names(schema)
        entries = [st.tuples(names, self.build(extra_values))] if isinstance(extra_values, Mapping) else []
        entries += [st.tuples(_matching(pattern), self.build(sub)) for pattern, sub in patterns.items()]
        extra = st.lists(st.one_of(entries), max_size=4).map(lambda pairs: {k: v for k, v in pairs if k not in properties})
        return _sized(st.tuples(fixed, extra).map(lambda parts: {**parts[1], **parts[0]}), schema)

    def _names(self, schema: Schema) -> Strategy:
        names = schema.get("propertyNames")
        return self.build({**names, "type": "string"}) if isinstance(names, Mapping) else st.text(max_size=10)


def _decimal_forms(branches: Sequence[Schema]) -> tuple[Schema, str] | None:
    """(its number form, its string form's pattern) for a Decimal (`esk.domain.json_schema`), else None."""
    numbers = [b for b in branches if b.get("type") == "number"]
    patterns = [b["pattern"] for b in branches if b.get("type") == "string" and str(b.get("pattern", "")).startswith(DECIMAL_PATTERN_START)]
    return (numbers[0], patterns[0]) if len(branches) == 2 and numbers and patterns else None


def _decimals(number: Schema, pattern: str) -> Strategy:
    """A Decimal, as its text or as a JSON number. pydantic bounds its digits on the string
    form only (the pattern) and its value on the number form only (JSON Schema can say no
    more), while a payload is held to both whichever form it takes: an unbounded number
    drawn for a `max_digits` field would blame an innocent upcaster."""
    low, high, exclude_low, exclude_high = _bounds(number)
    step = number.get("multipleOf")

    def within(value: Decimal) -> bool:
        if low is not None and (value <= low if exclude_low else value < low):
            return False
        if high is not None and (value >= high if exclude_high else value > high):
            return False
        return step is None or value % Decimal(str(step)) == 0

    # Whole: the pattern's first branch ends without an anchor, so that the text "10000"
    # matches it somewhere, though pydantic refuses it for 4 whole digits.
    digits = _compiled(pattern)
    texts = st.from_regex(digits, fullmatch=True).filter(lambda text: within(Decimal(text)))
    numbers = texts.map(_as_number).filter(lambda n: digits.fullmatch(str(n)) is not None and within(Decimal(str(n))))
    return texts | numbers


def _as_number(text: str) -> int | float:
    value = Decimal(text)
    return int(value) if value == value.to_integral_value() else float(value)


def _merged(schema: Schema) -> Schema:
    """allOf as one schema: pydantic's allOf holds one schema, or ones without a keyword in common."""
    merged = {k: v for k, v in schema.items() if k != "allOf"}
    for part in schema["allOf"]:
        clash = (merged.keys() & part.keys()) - _IGNORED
        if clash:
            raise Unsupported(f"allOf with {sorted(clash)[0]!r} in more than one part")
        merged.update(part)
    return merged


def _bounds(schema: Schema) -> tuple[float | None, float | None, bool, bool]:
    """(low, high, low excluded, high excluded), in draft 2020-12's spelling (pydantic's)."""
    low, high = schema.get("exclusiveMinimum", schema.get("minimum")), schema.get("exclusiveMaximum", schema.get("maximum"))
    return low, high, "exclusiveMinimum" in schema, "exclusiveMaximum" in schema


def _integers(schema: Schema) -> Strategy:
    low, high, exclude_low, exclude_high = _bounds(schema)
    lowest = None if low is None else int(low) + 1 if exclude_low and low == int(low) else _ceil(low)
    highest = None if high is None else int(high) - 1 if exclude_high and high == int(high) else _floor(high)
    if lowest is not None and highest is not None and lowest > highest:
        return st.nothing()  # a number strictly between two neighbouring integers
    step = schema.get("multipleOf")
    if step is None:
        return st.integers(lowest, highest)
    if step != int(step):
        raise Unsupported(f"multipleOf {step} on an integer")
    step = int(step)
    return st.integers(None if lowest is None else -(-lowest // step), None if highest is None else highest // step).map(lambda k: k * step)


def _floats(schema: Schema) -> Strategy:
    low, high, exclude_low, exclude_high = _bounds(schema)
    return st.floats(low, high, allow_nan=False, allow_infinity=False, exclude_min=exclude_low and low is not None, exclude_max=exclude_high and high is not None)


def _strings(schema: Schema) -> Strategy:
    low, high = schema.get("minLength", 0), schema.get("maxLength")
    if "format" in schema:
        if schema["format"] not in _FORMATS:
            raise Unsupported(f"string format {schema['format']!r}")
        strings = _FORMATS[schema["format"]]
    elif "pattern" in schema:
        strings = _matching(schema["pattern"])
    else:
        return st.text(min_size=low, max_size=high)
    return strings.filter(lambda s: len(s) >= low and (high is None or len(s) <= high))


def _matching(pattern: str) -> Strategy:
    """Strings in which `pattern` matches, as JSON Schema's pattern means it (anywhere)."""
    # Python's re is looser than ECMA-262 and pydantic's Rust engine: its `$` also matches
    # before a trailing newline, and `\d`, `\w` take any script's digits and letters. With
    # `\Z` for each `$` and ASCII classes, every string drawn matches under all three readings.
    return st.from_regex(_compiled(pattern))


def _compiled(pattern: str) -> re.Pattern[str]:
    try:
        return re.compile(_ends_as_ecma(pattern), re.ASCII)
    except re.error as error:  # an ECMA-262 construct Python's re does not have
        raise Unsupported(f"pattern {pattern!r} ({error})") from None


def _ends_as_ecma(pattern: str) -> str:
    """Each `$` outside a character class as `\\Z`: the end of the text alone, wherever the
    `$` stands (a Decimal's pattern has one inside a group)."""
    out: list[str] = []
    escaped = in_class = False
    for char in pattern:
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = True
        elif in_class:
            in_class = char != "]"
        elif char == "[":
            in_class = True
        elif char == "$":
            char = "\\Z"
        out.append(char)
    return "".join(out)


def _sized(objects: Strategy, schema: Schema) -> Strategy:
    low, high = schema.get("minProperties", 0), schema.get("maxProperties")
    if not low and high is None:
        return objects
    return objects.filter(lambda o: len(o) >= low and (high is None or len(o) <= high))


def _key(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


def _ceil(value: float) -> int:
    return -int(-value // 1)


def _floor(value: float) -> int:
    return int(value // 1)
