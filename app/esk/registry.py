"""Finds the user's own definitions: the settings name them as "module:attribute", and the
module is imported from the directory esk runs in (as uvicorn finds an app)."""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

from .domain.aggregate import AggregateType

Registry = dict[str, AggregateType[Any]]
# Path segments the HTTP API uses for itself under /v1/.
RESERVED_NAMES = frozenset({"commands", "projections"})


class ModuleMissing(LookupError):
    """The module a setting names is not there (as opposed to one that fails to import)."""


def load_object(spec: str, setting: str) -> Any:
    """The attribute `spec` names; `setting` is the variable that gave it, for the errors."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"{setting} must look like 'package.module:ATTRIBUTE', got {spec!r}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name is None or not module_name.startswith(error.name):
            raise  # the module exists; something it imports does not
        raise ModuleMissing(
            f"{setting}={spec}: no module {module_name!r} in {os.getcwd()} or on the Python path; "
            f"set {setting} to where yours are"
        ) from None
    try:
        return getattr(module, attribute)
    except AttributeError:
        raise LookupError(f"{setting}={spec}: module {module_name!r} has no {attribute!r}") from None


def load_registry(spec: str) -> Registry:
    """The aggregate types `spec` names (the setting ESK_DOMAIN), by name."""
    registry: Registry = {}
    for aggregate in load_object(spec, "ESK_DOMAIN"):
        if not isinstance(aggregate, AggregateType):
            raise TypeError(f"{spec} holds {aggregate!r}, not an AggregateType")
        if aggregate.name in RESERVED_NAMES:
            raise ValueError(f"aggregate type name {aggregate.name!r} is reserved by the HTTP API")
        if aggregate.name in registry:
            raise ValueError(f"aggregate type {aggregate.name!r} is registered twice")
        registry[aggregate.name] = aggregate
    return registry
