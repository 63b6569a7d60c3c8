"""Where two JSON Schemas differ, field by field.

The walk follows `$ref`s on both sides, so a renamed nested model with the same shape is no
difference, and it ignores annotations (titles, descriptions: a docstring is not a shape).
It says *where* and *what* changed; whether a change breaks anyone is the caller's question
(`esk.schema.check`), since it depends on who reads the payload.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from ..domain.json_schema import decimal_bounds

Schema = Mapping[str, Any]
ChangeKind = Literal["added", "removed", "now required", "now optional", "changed"]

ANNOTATIONS = frozenset({"title", "description", "examples", "$comment"})
# Keywords whose value is one subschema; the path each one adds to its field's.
_SUBSCHEMAS = {"items": "[]", "additionalProperties": ".*", "contains": "[]", "not": "", "propertyNames": ""}
# Keywords whose value is a list of subschemas, compared pairwise when both lists are as long.
_SUBSCHEMA_LISTS = frozenset({"anyOf", "oneOf", "allOf", "prefixItems"})
# Keywords whose value is a map of name -> subschema, compared name by name when canonical.
_SUBSCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
# Where the walk finds the schemas it reads; never a difference by itself.
_REFERENCES = frozenset({"$ref", "$defs", "definitions"})
# Lists whose order means nothing.
_UNORDERED = frozenset({"required", "enum", "type"})


@dataclass(frozen=True)
class Change:
    """One difference at one field. `before`/`after` are the field's schemas (None when the
    field is absent on that side); `walked` names the keywords whose differences are changes
    of their own (nested fields), so that `before`/`after` minus them is what changed here."""

    path: str
    kind: ChangeKind
    before: Schema | None = None
    after: Schema | None = None
    required: bool = False  # of an added field: must a payload carry it?
    walked: frozenset[str] = field(default=frozenset())

    def describe(self) -> str:
        """The change in words, e.g. "new required field `currency`"."""
        name = f"field `{self.path}`" if self.path else "the payload"
        if self.kind == "added":
            return f"new {'required' if self.required else 'optional'} field `{self.path}`"
        if self.kind == "removed":
            return f"{name} removed"
        if self.kind == "now required":
            return f"{name} is now required"
        if self.kind == "now optional":
            return f"{name} is no longer required"
        if (bounds := self.decimal_bounds()) is not None:
            return f"{name}, a Decimal of {_digits(*bounds[0])}, is one of {_digits(*bounds[1])}"
        return f"{name} changed from {self.shown(self.before)} to {self.shown(self.after)}"

    def decimal_bounds(self) -> tuple[tuple[int | None, int | None], tuple[int | None, int | None]] | None:
        """Of a Decimal whose digits alone changed: its (max_digits, decimal_places) before
        and after, read from its text's pattern (`esk.domain.json_schema`); else None."""
        if self.kind != "changed" or self.before is None or self.after is None:
            return None
        before, after = _own(self.before, self.walked), _own(self.after, self.walked)
        if {k: v for k, v in before.items() if k != "pattern"} != {k: v for k, v in after.items() if k != "pattern"}:
            return None
        old, new = decimal_bounds(str(before.get("pattern", ""))), decimal_bounds(str(after.get("pattern", "")))
        return None if old is None or new is None else (old, new)

    def shown(self, schema: Schema | None) -> str:
        """This field's own keywords (not its nested fields'), compact."""
        if schema is None:
            return "nothing"
        text = json.dumps(canonical(_own(schema, self.walked), {}), sort_keys=True, separators=(",", ":"))
        return text if len(text) <= 160 else text[:157] + "..."


def _digits(max_digits: int | None, decimal_places: int | None) -> str:
    return f"max_digits {'unbounded' if max_digits is None else max_digits}, decimal_places {'unbounded' if decimal_places is None else decimal_places}"


def differences(before: Schema, after: Schema) -> list[Change]:
    """Every change from `before` to `after`, outermost first; empty when they have one shape."""
    return list(_walk(before, after, "", before, after, set()))


def changes(before: Schema, after: Schema) -> list[Change]:
    """How `after` differs from `before` (of another shape), field by field: the whole of it
    when no field names the difference."""
    return differences(before, after) or [Change("", "changed", before, after)]


def same_shape(before: Schema, after: Schema) -> bool:
    return bool(canonical(before, before) == canonical(after, after))


def resolve(schema: Schema, root: Schema) -> tuple[Schema, str | None]:
    """The schema a local `$ref` points to (its sibling keywords kept), and the reference."""
    reference: str | None = None
    seen: set[str] = set()
    while isinstance(schema.get("$ref"), str) and schema["$ref"] not in seen:
        reference = schema["$ref"]
        seen.add(reference)
        target = _pointer(root, reference)
        if target is None:
            break
        schema = {**target, **{k: v for k, v in schema.items() if k != "$ref"}}
    return schema, reference


def canonical(schema: Any, root: Schema, stack: tuple[str, ...] = ()) -> Any:
    """`schema` with its local references inlined (a recursive one stays a `$ref`), its
    annotations dropped and its unordered lists sorted: equal for equal shapes."""
    if not isinstance(schema, Mapping):
        return schema
    reference = schema.get("$ref")
    if isinstance(reference, str):
        resolved, _ = resolve(schema, root)
        if reference in stack or "$ref" in resolved:  # recursive, or pointing outside `root`
            return {"$ref": reference}
        return canonical(resolved, root, (*stack, reference))
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in ANNOTATIONS or key in _REFERENCES:
            continue
        if key in _SUBSCHEMA_MAPS and isinstance(value, Mapping):
            out[key] = {name: canonical(sub, root, stack) for name, sub in value.items()}
        elif key in _SUBSCHEMAS:
            out[key] = canonical(value, root, stack)
        elif key in _SUBSCHEMA_LISTS and isinstance(value, list):
            out[key] = [canonical(sub, root, stack) for sub in value]
        elif key in _UNORDERED and isinstance(value, list):
            out[key] = sorted(value, key=lambda v: json.dumps(v, sort_keys=True))
        else:
            out[key] = value
    return out


def _walk(before: Schema | bool, after: Schema | bool, path: str, root_before: Schema, root_after: Schema, seen: set[tuple[str, str]]) -> Iterator[Change]:
    before, ref_before = resolve(_as_schema(before), root_before)
    after, ref_after = resolve(_as_schema(after), root_after)
    if ref_before is not None and ref_after is not None:
        # A recursive model leads back to a pair already under way: its changes are reported there.
        if (ref_before, ref_after) in seen:
            return
        seen = {*seen, (ref_before, ref_after)}
    walked: set[str] = set()
    nested: list[Change] = []
    properties_before, properties_after = before.get("properties"), after.get("properties")
    if isinstance(properties_before, Mapping) and isinstance(properties_after, Mapping):
        walked |= {"properties", "required"}
        nested += _properties(before, after, path, root_before, root_after, seen)
    for key in sorted(before.keys() & after.keys()):
        if key in _SUBSCHEMAS and isinstance(before[key], Mapping) and isinstance(after[key], Mapping):
            walked.add(key)
            nested += _walk(before[key], after[key], path + _SUBSCHEMAS[key], root_before, root_after, seen)
        elif key in _SUBSCHEMA_LISTS and isinstance(before[key], list) and isinstance(after[key], list) and len(before[key]) == len(after[key]):
            walked.add(key)
            for index, (sub_before, sub_after) in enumerate(zip(before[key], after[key], strict=True)):
                sub_path = f"{path}[{index}]" if key == "prefixItems" else path
                nested += _walk(sub_before, sub_after, sub_path, root_before, root_after, seen)
    if canonical(_own(before, walked), root_before) != canonical(_own(after, walked), root_after):
        yield Change(path, "changed", before, after, walked=frozenset(walked))
    yield from nested


def _properties(before: Schema, after: Schema, path: str, root_before: Schema, root_after: Schema, seen: set[tuple[str, str]]) -> Iterator[Change]:
    properties_before, properties_after = before["properties"], after["properties"]
    required_before, required_after = set(before.get("required", ())), set(after.get("required", ()))
    for name in sorted(properties_before.keys() | properties_after.keys()):
        field_path = f"{path}.{name}" if path else name
        if name not in properties_after:
            yield Change(field_path, "removed", before=properties_before[name])
        elif name not in properties_before:
            yield Change(field_path, "added", after=properties_after[name], required=name in required_after)
        else:
            if name in required_after - required_before:
                yield Change(field_path, "now required", properties_before[name], properties_after[name])
            elif name in required_before - required_after:
                yield Change(field_path, "now optional", properties_before[name], properties_after[name])
            yield from _walk(properties_before[name], properties_after[name], field_path, root_before, root_after, seen)


def _as_schema(schema: Schema | bool) -> Schema:
    """JSON Schema's `true` and `false` as the schemas they stand for."""
    if isinstance(schema, bool):
        return {} if schema else {"not": {}}
    return schema


def _own(schema: Schema, walked: Collection[str]) -> dict[str, Any]:
    """The keywords that describe this field itself, not its nested fields."""
    return {k: v for k, v in schema.items() if k not in walked and k not in ANNOTATIONS and k not in _REFERENCES}


def _pointer(root: Schema, reference: str) -> Schema | None:
    """The subschema a local JSON pointer (`#/$defs/Line`) names; None for any other reference."""
    if not reference.startswith("#"):
        return None
    node: Any = root
    for part in reference[1:].split("/")[1:] if reference != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node if isinstance(node, Mapping) else None
