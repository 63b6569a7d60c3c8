"""Reads the current generation of a read model with delta-rs: no JVM, fit for the HTTP API."""

from __future__ import annotations

from datetime import UTC, date, datetime
from typing import Any

from ..settings import Settings
from .catalog import Keepers, ReadModel, Tables, arrow_dataset, configured_read_models
from .parking import ParkedAggregate
from .positions import Positions, read_model_positions


class ReadModelNotFound(LookupError):
    pass


class ReadModelNotBuilt(LookupError):
    pass


class BadFilter(ValueError):
    pass


class ReadModelRows:
    """The rows of the application's read models; the read models are looked up on first use."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.tables = Tables(settings.projections.warehouse_dir)
        self._models: dict[str, ReadModel] | None = None

    def model(self, name: str) -> ReadModel:
        try:
            return self._loaded()[name]
        except KeyError:
            raise ReadModelNotFound(name) from None

    def names(self) -> list[str]:
        return sorted(self._loaded())

    def _loaded(self) -> dict[str, ReadModel]:
        if self._models is None:
            self._models = {n: p.model for n, p in configured_read_models(self.settings).items()}
        return self._models

    def read(self, name: str, filters: dict[str, str], limit: int) -> list[dict[str, Any]]:
        return read_rows(self.tables, self.model(name), filters, limit)

    def keepers(self, name: str) -> Keepers | None:
        """The runs keeping the read model's generations now (Tables.keepers); None when this
        process cannot tell (the warehouse's locks cannot be read from here)."""
        try:
            return self.tables.keepers(name)
        except OSError:
            return None

    def parked(self, name: str) -> list[ParkedAggregate]:
        """The aggregates the read model's current table holds back (parking.py)."""
        self.model(name)
        return self.tables.parked_in(name, self.tables.current_generation(name))

    def positions(self, name: str) -> Positions:
        """What the read model's current table reflects (see projections.positions)."""
        self.model(name)
        positions = read_model_positions(self.tables, name)
        if positions is None:
            raise ReadModelNotBuilt(name)
        return positions


def read_rows(tables: Tables, model: ReadModel, filters: dict[str, str], limit: int) -> list[dict[str, Any]]:
    """Rows of `model` where each column equals the given value (converted to the column's
    type), in the read model's order, at most `limit`."""
    import pyarrow as pa
    import pyarrow.compute as pc

    name = model.name
    path = tables.current_path(name)
    if path is None:
        raise ReadModelNotBuilt(name)
    dataset = arrow_dataset(path)
    condition = None
    for column, raw in filters.items():
        if column not in dataset.schema.names:
            raise BadFilter(f"{name} has no column {column!r}; columns: {', '.join(dataset.schema.names)}")
        arrow_type = dataset.schema.field(column).type
        # Compared as the table's type: delta-rs writes strings as string_view, Spark as
        # string, and pyarrow compares neither with the other.
        term = pc.field(column).cast(arrow_type) == _convert(column, raw, arrow_type, pa)
        condition = term if condition is None else condition & term
    sort_keys = [(c.lstrip("-"), "descending" if c.startswith("-") else "ascending") for c in model.order_by]
    if not sort_keys:
        table = dataset.head(limit, filter=condition)
    else:
        # The first `limit` in order, kept as the scan goes: a read holds a batch and those
        # rows, not every row that matches (all of a big table's, without filters).
        table = dataset.schema.empty_table()
        for batch in dataset.to_batches(filter=condition):
            if batch.num_rows:
                candidates = pa.concat_tables([table, pa.Table.from_batches([batch])])
                table = candidates.take(pc.select_k_unstable(candidates, k=limit, sort_keys=sort_keys))
        table = table.sort_by(sort_keys)
    return [_jsonable(row) for row in table.to_pylist()]


def _convert(column: str, raw: str, arrow_type: Any, pa: Any) -> Any:
    try:
        if pa.types.is_boolean(arrow_type):
            return {"true": True, "false": False}[raw]  # as JSON writes them, and the rows show them
        if pa.types.is_integer(arrow_type):
            return pa.scalar(int(raw), type=arrow_type)  # one the column cannot hold is refused (OverflowError)
        if pa.types.is_floating(arrow_type):
            return float(raw)
        if pa.types.is_date(arrow_type):
            return date.fromisoformat(raw)
        if pa.types.is_timestamp(arrow_type):
            moment = datetime.fromisoformat(raw)
            if arrow_type.tz is None:  # TIMESTAMP_NTZ: a wall-clock time, compared as given
                return moment.replace(tzinfo=None) if moment.tzinfo is None else moment.astimezone(UTC).replace(tzinfo=None)
            # A TIMESTAMP is an instant, kept in UTC: a value without an offset is read as UTC
            # (the sessions' time zone), as the rows show them
            return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)
    except (ValueError, OverflowError, KeyError):  # pyarrow's ArrowInvalid is a ValueError
        raise BadFilter(f"{column}: {raw!r} is not {_as_given(arrow_type, pa)}") from None
    if pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type) or pa.types.is_string_view(arrow_type):
        return raw
    # as /openapi.json states: no filter on it (pyarrow could not compare a string with it)
    raise BadFilter(f"{column} is a {arrow_type} column: rows are not filtered on one")


def _as_given(arrow_type: Any, pa: Any) -> str:
    """What a filter on a column of `arrow_type` is given, in words rather than Arrow's."""
    if pa.types.is_boolean(arrow_type):
        return "true or false"
    if pa.types.is_integer(arrow_type):
        return f"a whole number a {arrow_type.bit_width}-bit column holds"
    if pa.types.is_floating(arrow_type):
        return "a number"
    if pa.types.is_date(arrow_type):
        return "a date (YYYY-MM-DD)"
    return "a date and time in ISO 8601 (2025-06-01T09:30:00Z)"  # a timestamp: the types _convert takes


def _jsonable(row: dict[str, Any]) -> dict[str, Any]:
    return {k: v.isoformat() if isinstance(v, (date, datetime)) else v for k, v in row.items()}
