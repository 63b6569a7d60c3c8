"""The contract in docs/product.md (and the README) names every setting, every metric and
every name `import esk` gives: a new one that the docs do not tell of is a mistake found
here, not by a user."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import get_args

import prometheus_client
from pydantic import BaseModel

import esk
import esk.metrics  # defines esk's metrics in the default registry
from esk.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
DOCS = (ROOT / "docs" / "product.md").read_text() + (ROOT / "README.md").read_text()


def _environment_names(model: type[BaseModel], prefix: str = "ESK_") -> Iterator[str]:
    for name, field in model.model_fields.items():
        groups = [kind for kind in (field.annotation, *get_args(field.annotation)) if isinstance(kind, type) and issubclass(kind, BaseModel)]
        if groups:  # a group of settings, optional or not
            yield from _environment_names(groups[0], f"{prefix}{name.upper()}__")
        else:
            yield f"{prefix}{name.upper()}"


LINES = DOCS.splitlines()
# families a settings table names with a star (`ESK_KAFKA__SASL_*`)
FAMILIES = [family for line in LINES if line.startswith("|") for family in re.findall(r"`(ESK_[A-Z_]+)\*`", line)]


def _told(name: str) -> bool:
    """`name` in full, as the docs shorten it beside a setting of its group (`…__PORT` on
    the line of `ESK_BROKER__HOST`), or in a family a settings table names."""
    group, _, last = name.rpartition("__")
    shortened = bool(group) and any(f"`…__{last}`" in line and f"`{group}__" in line for line in LINES)
    return f"`{name}`" in DOCS or shortened or any(name.startswith(family) for family in FAMILIES)


def test_every_setting_is_in_the_docs() -> None:
    names = list(_environment_names(Settings))
    assert "ESK_API__OUTCOME_TIMEOUT_S" in names and "ESK_DOMAIN" in names
    assert [name for name in names if not _told(name)] == []


def test_every_metric_is_in_the_docs() -> None:
    # a counter's family drops the `_total` its samples have
    names = {
        family.name + ("_total" if family.type == "counter" else "")
        for family in prometheus_client.REGISTRY.collect()
        if family.name.startswith("esk_")
    }
    assert "esk_commands_total" in names and "esk_commit_seconds" in names
    assert sorted(name for name in names if not re.search(rf"`{name}[`{{]", DOCS)) == []


def test_every_name_a_user_imports_is_in_the_docs() -> None:
    assert "AggregateType" in esk.__all__
    assert [name for name in esk.__all__ if f"`{name}`" not in DOCS] == []
