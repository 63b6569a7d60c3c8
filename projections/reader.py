"""Reads the current generation of a read model with delta-rs: no JVM, fit for the HTTP API."""

from __future__ import annotations

from datetime import date, datetime
from typing import Any

from projections.catalog import CATALOG, Tables


class ReadModelNotFound(LookupError):
    pass


class ReadModelNotBuilt(LookupError):
    pass


class BadFilter(ValueError):
    pass


def read_rows(tables: Tables, name: str, filters: dict[str, str], limit: int) -> list[dict[str, Any]]:
    """Rows of `name` where each column equals the given value (converted to the column's
    type), in the read model's order, at most `limit`."""
    import pyarrow as pa
    import pyarrow.compute as pc
    from deltalake import DeltaTable

    model = CATALOG.get(name)
    if model is None:
        raise ReadModelNotFound(name)
    path = tables.current_path(name)
    if path is None:
        raise ReadModelNotBuilt(name)
    dataset = DeltaTable(str(path)).to_pyarrow_dataset()
    condition = None
    for column, raw in filters.items():
        if column not in dataset.schema.names:
            raise BadFilter(f"{name} has no column {column!r}; columns: {', '.join(dataset.schema.names)}")
        value = _convert(raw, dataset.schema.field(column).type, pa)
        term = pc.field(column) == value
        condition = term if condition is None else condition & term
    table = dataset.to_table(filter=condition)
    if model.order_by:
        table = table.sort_by([(c.lstrip("-"), "descending" if c.startswith("-") else "ascending") for c in model.order_by])
    return [_jsonable(row) for row in table.slice(0, limit).to_pylist()]


def _convert(raw: str, arrow_type: Any, pa: Any) -> Any:
    try:
        if pa.types.is_integer(arrow_type):
            return int(raw)
        if pa.types.is_floating(arrow_type):
            return float(raw)
        if pa.types.is_date(arrow_type):
            return date.fromisoformat(raw)
        if pa.types.is_timestamp(arrow_type):
            return datetime.fromisoformat(raw)
    except ValueError:
        raise BadFilter(f"{raw!r} is not a valid {arrow_type}") from None
    return raw


def _jsonable(row: dict[str, Any]) -> dict[str, Any]:
    return {k: v.isoformat() if isinstance(v, (date, datetime)) else v for k, v in row.items()}
