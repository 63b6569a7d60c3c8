"""The JSON Schema esk keeps of a model: pydantic's, with a Decimal written the same way
whatever pydantic release is installed.

What esk keeps of a schema outlives the pydantic that wrote it: the lock file is committed
and `esk schema check` compares a later release's schemas with it; a state's shape is a hash
of its schema, and a new hash rebuilds every aggregate's state from its events. pydantic
2.14 stopped writing the pattern that bounds a Decimal's digits on its string form (2.13
and earlier wrote one), so an upgrade alone would have read as a change of every model with
a Decimal, and a command's narrowed `max_digits` no longer as one. Here a Decimal is written
as pydantic up to 2.13 wrote it, byte for byte, so that locks and state shapes written then
stay valid; /openapi.json and the AsyncAPI document describe payloads as the lock does.
"""

from __future__ import annotations

import re
from decimal import Decimal
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import DEFAULT_REF_TEMPLATE, GenerateJsonSchema, JsonSchemaValue
from pydantic_core import core_schema

# Not empty, nor only signs and points; then the sign, then leading zeros (not digits counted).
DECIMAL_PATTERN_START = r"^(?!^[-+.]*$)[+-]?0*"


def decimal_pattern(max_digits: int | None, decimal_places: int | None) -> str:
    """The pattern a Decimal's text matches within `max_digits` and `decimal_places`.
    Trailing zeros of the fraction do not count, as pydantic counts them; a text with an
    exponent is not matched (a regular expression cannot count its digits)."""
    if max_digits is None:
        fraction = r"\d*" if decimal_places is None else rf"\d{{0,{decimal_places}}}0*"
        return rf"{DECIMAL_PATTERN_START}\d*\.?{fraction}$"
    whole = whole_digits(max_digits, decimal_places)
    # A point's text: at most max_digits digits and the point, before trailing zeros.
    pointed = rf"(?=[\d.]{{1,{max_digits + 1}}}0*$)"
    if decimal_places is None:
        pointed += r"\d*\.\d*0*$"
    else:
        pointed += rf"\d{{0,{whole}}}\.\d{{0,{decimal_places}}}0*$"
    return rf"{DECIMAL_PATTERN_START}(?:\d{{0,{whole}}}|{pointed})"


def whole_digits(max_digits: int | None, decimal_places: int | None) -> int | None:
    """The digits a Decimal may have before its point (None: any)."""
    if max_digits is None:
        return None
    return max_digits if decimal_places is None else max(0, max_digits - decimal_places)


def decimal_bounds(pattern: str) -> tuple[int | None, int | None] | None:
    """(max_digits, decimal_places) of a pattern `decimal_pattern` wrote; None for another."""
    if not pattern.startswith(DECIMAL_PATTERN_START):
        return None
    digits = re.search(r"\{1,(\d+)\}", pattern)  # the lookahead's: max_digits and the point
    places = re.search(r"\\\.\??\\d\{0,(\d+)\}", pattern)
    bounds = (int(digits[1]) - 1 if digits else None, int(places[1]) if places else None)
    return bounds if decimal_pattern(*bounds) == pattern else None


class EskJsonSchema(GenerateJsonSchema):
    """pydantic's JSON Schema, a Decimal's as `decimal_pattern` says (see the module)."""

    def decimal_schema(self, schema: core_schema.DecimalSchema) -> JsonSchemaValue:
        text = self.str_schema(core_schema.str_schema(pattern=decimal_pattern(schema.get("max_digits"), schema.get("decimal_places"))))
        if self.mode != "validation":
            return text
        number = core_schema.float_schema(
            allow_inf_nan=schema.get("allow_inf_nan"),
            multiple_of=_float(schema.get("multiple_of")),
            le=_float(schema.get("le")),
            ge=_float(schema.get("ge")),
            lt=_float(schema.get("lt")),
            gt=_float(schema.get("gt")),
        )
        return {"anyOf": [self.float_schema(number), text]}


def _float(bound: Decimal | None) -> float | None:
    return None if bound is None else float(bound)


def model_schema(model: type[BaseModel], ref_template: str = DEFAULT_REF_TEMPLATE) -> dict[str, Any]:
    """`model`'s JSON Schema in validation mode, as esk keeps it."""
    return model.model_json_schema(ref_template=ref_template, schema_generator=EskJsonSchema)
