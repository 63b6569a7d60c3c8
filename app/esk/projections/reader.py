"""Reads the current generation of a read model with delta-rs: no JVM, fit for the HTTP API."""

from __future__ import annotations

import base64
import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, date, datetime, time
from decimal import Decimal
from typing import Any

import orjson

from ..settings import Settings
from .catalog import Keepers, ReadModel, Tables, arrow_dataset, configured_read_models
from .parking import ParkedAggregate
from .positions import Positions, read_model_positions

# A decimal filter's value, as /openapi.json states it: no exponent, no NaN
DECIMAL_TEXT = re.compile(r"^-?[0-9]+(\.[0-9]+)?$")


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

    def view(self, name: str, filters: dict[str, str], limit: int) -> ReadModelView:
        """Its rows and the aggregates it holds back, both of the generation readers use
        now: read one after the other, a rebuild's switch between them would pair one
        table's rows with another's parked aggregates."""
        model = self.model(name)
        generation = self.tables.current_generation(name)
        rows = read_rows(self.tables, model, filters, limit, generation)
        return ReadModelView(rows, self.tables.parked_in(name, generation))

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


@dataclass(frozen=True)
class ReadModelView:
    rows: list[dict[str, Any]]
    parked: list[ParkedAggregate]


def read_rows(
    tables: Tables, model: ReadModel, filters: dict[str, str], limit: int, generation: int | None = None
) -> list[dict[str, Any]]:
    """Rows of `model` where each column equals the given value (converted to the column's
    type), in the read model's order, at most `limit`: of `generation`, or the one readers
    use."""
    import pyarrow as pa
    import pyarrow.compute as pc

    name = model.name
    generation = tables.current_generation(name) if generation is None else generation
    if generation is None:
        raise ReadModelNotBuilt(name)
    dataset = arrow_dataset(tables.path(name, generation))
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
    if unknown := [column for column, _ in sort_keys if column not in dataset.schema.names]:
        # its code changed since the table was built: a run of it says what is amiss
        raise LookupError(
            f"{name}'s order_by names {', '.join(unknown)}, which its current table does not have (its columns: "
            f"{', '.join(dataset.schema.names)}); `esk project run {name}` tells what its code declares"
        )
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
    as_json = {field.name: _json_value(field.type, pa) for field in table.schema}
    return [{column: as_json[column](value) for column, value in row.items()} for row in table.to_pylist()]


def _convert(column: str, raw: str, arrow_type: Any, pa: Any) -> Any:
    try:
        if pa.types.is_boolean(arrow_type):
            return {"true": True, "false": False}[raw]  # as JSON writes them, and the rows show them
        if pa.types.is_integer(arrow_type):
            return pa.scalar(int(raw), type=arrow_type)  # one the column cannot hold is refused (OverflowError)
        if pa.types.is_floating(arrow_type):
            return float(raw)
        if pa.types.is_decimal(arrow_type):
            if not DECIMAL_TEXT.match(raw):
                raise ValueError(raw)
            return pa.scalar(Decimal(raw), type=arrow_type)  # more places or digits than it holds: refused
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
    if pa.types.is_decimal(arrow_type):
        return f"a decimal number a decimal({arrow_type.precision},{arrow_type.scale}) column holds"
    if pa.types.is_date(arrow_type):
        return "a date (YYYY-MM-DD)"
    return "a date and time in ISO 8601 (2025-06-01T09:30:00Z)"  # a timestamp: the types _convert takes


def _json_value(arrow_type: Any, pa: Any) -> Callable[[Any], Any]:
    """How a value of a column of `arrow_type` goes into a JSON answer, as /openapi.json
    states it: a decimal as its exact text (a JSON number would reach most clients as a
    double), binary as base64, a date or time in ISO 8601, a map as an object, structs and
    arrays as their parts are."""
    if pa.types.is_struct(arrow_type):
        fields = [(field.name, _json_value(field.type, pa)) for field in arrow_type]
        return _unless_null(lambda value: {name: convert(value[name]) for name, convert in fields})
    if pa.types.is_map(arrow_type):
        key, item = _json_value(arrow_type.key_type, pa), _json_value(arrow_type.item_type, pa)
        return _unless_null(lambda pairs: {_object_key(key(k)): item(v) for k, v in pairs})
    if any(is_list(arrow_type) for is_list in (pa.types.is_list, pa.types.is_large_list, pa.types.is_fixed_size_list,
                                               pa.types.is_list_view, pa.types.is_large_list_view)):
        element = _json_value(arrow_type.value_type, pa)
        return _unless_null(lambda values: [element(v) for v in values])
    if pa.types.is_decimal(arrow_type):
        return _unless_null(lambda value: format(value, "f"))  # fixed-point: 0.00, never 0E-2
    if any(is_binary(arrow_type) for is_binary in (pa.types.is_binary, pa.types.is_large_binary, pa.types.is_fixed_size_binary,
                                                   pa.types.is_binary_view)):
        return _unless_null(lambda value: base64.b64encode(value).decode("ascii"))
    if pa.types.is_temporal(arrow_type):
        return _unless_null(lambda value: value.isoformat() if isinstance(value, (date, datetime, time)) else str(value))
    return _as_it_is


def _as_it_is(value: Any) -> Any:
    return value


def _unless_null(convert: Callable[[Any], Any]) -> Callable[[Any], Any]:
    return lambda value: None if value is None else convert(value)


def _object_key(key: Any) -> str:
    """A JSON object's key: a map's keys may be numbers, dates, booleans."""
    return key if isinstance(key, str) else orjson.dumps(key).decode()
