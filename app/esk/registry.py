"""Finds the user's own definitions: the settings name them as "module:attribute", and the
module is imported from the directory esk runs in (as uvicorn finds an app)."""

from __future__ import annotations

import importlib
import os
import sys
import sysconfig
import traceback
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from .domain.aggregate import AggregateType

Registry = dict[str, AggregateType[Any]]
# Path segments the HTTP API uses for itself under /v1/.
T = TypeVar("T")
RESERVED_NAMES = frozenset({"commands", "projections"})


class SettingMistake(TypeError, ValueError):
    """A setting names what cannot serve: not "module:attribute", not a list of the kind it
    must hold, a name twice. (A TypeError and a ValueError both, as these were before.)"""


class ModuleMissing(LookupError):
    """The module a setting names is not there (as opposed to one that fails to import)."""


class ImportFailed(Exception):
    """The module a setting names raised as it was imported: a mistake in the user's code,
    told in a line with where it happened, not a traceback through esk's loader."""


def load_object(spec: str, setting: str) -> Any:
    """The attribute `spec` names; `setting` is the variable that gave it, for the errors."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise SettingMistake(f"{setting} must look like 'package.module:ATTRIBUTE', got {spec!r}")
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
    except ImportError:
        raise  # told with what is missing by those who load
    except Exception as error:
        raise ImportFailed(f"{setting}={spec}: importing {module_name} failed {_where(error)}: {type(error).__name__}: {error}") from error
    try:
        return getattr(module, attribute)
    except AttributeError:
        raise LookupError(f"{setting}={spec}: module {module_name!r} has no {attribute!r}") from None


def _where(error: BaseException) -> str:
    """Where in the user's code `error` was raised: a syntax error's place; else the innermost
    frame of a file under the working directory, else of one that is neither Python's own
    nor an installed package's (a project installed as one: the innermost of all)."""
    if isinstance(error, SyntaxError) and error.filename:
        return f"at {error.filename}:{error.lineno}"
    frames = traceback.extract_tb(error.__traceback__)
    here = os.path.join(os.getcwd(), "")
    python = os.path.join(sysconfig.get_paths()["stdlib"], "")

    def installed(path: str) -> bool:
        return path.startswith(("<", python)) or "site-packages" in path

    theirs = [f for f in frames if f.filename.startswith(here) and not installed(f.filename)]
    theirs = theirs or [f for f in frames if not installed(f.filename)] or frames
    return f"at {theirs[-1].filename}:{theirs[-1].lineno}" if theirs else "as it was imported"


def load_optional(spec: str, set_explicitly: bool, load: Callable[[str], dict[str, T]]) -> dict[str, T]:
    """`load(spec)`; a project may have none of these: only a spec that was set explicitly
    must name a module that is there, the default finds the module if it is."""
    try:
        return load(spec)
    except ModuleMissing:
        if set_explicitly:
            raise
        return {}


def _described(item: Any) -> str:
    """An item of the wrong kind, in a few words: an esk object's repr (an AggregateType's,
    a Projection's) runs over a thousand characters."""
    named = getattr(item, "name", None) or getattr(getattr(item, "model", None), "name", None)
    if isinstance(named, str):
        return f"{type(item).__name__} {named!r}"
    text = repr(item)
    return text if len(text) <= 80 else f"{text[:77]}..."


def by_name(
    items: Iterable[Any], spec: str, kind: type[T], kind_name: str, name: Callable[[T], str], what: str
) -> dict[str, T]:
    """`items` (what `spec` named) by name, each checked to be a `kind` and named once."""
    if isinstance(items, (kind, str, bytes)) or not isinstance(items, Iterable):
        raise SettingMistake(f"{spec} names one {type(items).__name__}, not a list: it must name a list, each item {kind_name}")
    found: dict[str, T] = {}
    for item in items:
        if not isinstance(item, kind):
            raise SettingMistake(f"{spec} holds {_described(item)}, not {kind_name}")
        if name(item) in found:
            raise SettingMistake(f"{what} {name(item)!r} is registered twice")
        found[name(item)] = item
    return found


def load_registry(spec: str) -> Registry:
    """The aggregate types `spec` names (the setting ESK_DOMAIN), by name."""
    registry: Registry = by_name(
        load_object(spec, "ESK_DOMAIN"), spec, AggregateType, "an AggregateType", lambda a: a.name, "aggregate type"
    )
    for name in registry.keys() & RESERVED_NAMES:
        raise SettingMistake(f"aggregate type name {name!r} is reserved by the HTTP API")
    return registry
