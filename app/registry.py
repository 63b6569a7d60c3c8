"""Loads the application's aggregate types from `ESK_DOMAIN` ("module:attribute")."""

from __future__ import annotations

import importlib
from typing import Any

from domain.aggregate import AggregateType

Registry = dict[str, AggregateType[Any]]
# Path segments the HTTP API uses for itself under /v1/.
RESERVED_NAMES = frozenset({"commands", "projections"})


def load_registry(spec: str) -> Registry:
    module_name, _, attribute = spec.partition(":")
    if not attribute:
        raise ValueError(f"ESK_DOMAIN must look like 'package.module:ATTRIBUTE', got {spec!r}")
    aggregates = getattr(importlib.import_module(module_name), attribute)
    registry: Registry = {}
    for aggregate in aggregates:
        if not isinstance(aggregate, AggregateType):
            raise TypeError(f"{spec} holds {aggregate!r}, not an AggregateType")
        if aggregate.name in RESERVED_NAMES:
            raise ValueError(f"aggregate type name {aggregate.name!r} is reserved by the HTTP API")
        if aggregate.name in registry:
            raise ValueError(f"aggregate type {aggregate.name!r} is registered twice")
        registry[aggregate.name] = aggregate
    return registry
