"""The event streams as DataFrames.

Events are read through Spark's Kafka source with read_committed isolation (Spark's
default is read_uncommitted, which would project aborted events). Payloads are decoded
with Spark schemas derived from the domain's pydantic event models, after older schema
versions are upcast by the very upcasters the domain uses.
"""

from __future__ import annotations

import datetime
import decimal
import enum
import math
import types
import typing
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from functools import lru_cache
from pathlib import Path
from typing import Any

import msgspec
import orjson
from pydantic import BaseModel, PlainSerializer, WrapSerializer
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import (
    ArrayType,
    BooleanType,
    DataType,
    DateType,
    DecimalType,
    DoubleType,
    IntegerType,
    LongType,
    MapType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from ..domain.aggregate import AggregateType, Event
from ..kafka.topics import TopicNames
from ..protocol import EventRecord
from ..registry import Registry, load_registry
from ..settings import Settings
from .catalog import ReadModelMistake

# As pydantic writes them in JSON, and Spark's from_json reads them back: a date as
# "2025-06-01", a datetime in ISO 8601 (any fraction, any offset), a Decimal as a string.
_SIMPLE: dict[Any, DataType] = {
    bool: BooleanType(), int: LongType(), float: DoubleType(), str: StringType(),  # bool before int: it is one
    datetime.datetime: TimestampType(), datetime.date: DateType(),  # datetime is a date
    # written as strings that Spark has no type of its own for: read as the text
    uuid.UUID: StringType(), datetime.time: StringType(), datetime.timedelta: StringType(), bytes: StringType(),
    typing.Any: StringType(),  # Spark's StringType reads any JSON value as its text
}


def spark_type(annotation: Any, constraints: typing.Sequence[Any] = ()) -> DataType:
    """The Spark type of a pydantic field annotation, given the field's `constraints` (a
    `FieldInfo`'s metadata); ReadModelMistake for one that has none (a read model then
    reads that field with its own `F.from_json`)."""
    origin = typing.get_origin(annotation)
    arguments = typing.get_args(annotation)
    if origin is typing.Annotated:  # constrained types (conint, Field(...) in Annotated)
        return spark_type(arguments[0], [*constraints, *_flat(arguments[1:])])
    if any(isinstance(c, (PlainSerializer, WrapSerializer)) for c in constraints):
        return StringType()  # written as its serializer makes it, not as its type would be: its JSON text
    if isinstance(annotation, type) and issubclass(annotation, decimal.Decimal):
        return _decimal_type(constraints)
    if origin in (typing.Union, types.UnionType):
        return _one_of([spark_type(a, constraints) for a in arguments if a is not type(None)])  # `X | None = Field(...)`: X's
    if origin in (list, set, frozenset) or (origin is tuple and len(arguments) == 2 and arguments[1] is Ellipsis):
        return ArrayType(spark_type(arguments[0]))
    if origin is tuple:  # a fixed tuple: a JSON array, whose items must share a type
        return ArrayType(_one_of([spark_type(a) for a in arguments], annotation))
    if origin is dict:
        return MapType(StringType(), spark_type(arguments[1]))  # a JSON object's keys are strings
    if origin is typing.Literal:
        return _one_of([spark_type(type(value)) for value in arguments])
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return spark_schema(annotation)
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return _one_of([spark_type(type(member.value)) for member in annotation])
    for kind, spark in _SIMPLE.items():  # a subclass (an IntEnum is an int) is its base's
        if annotation is kind or (isinstance(annotation, type) and isinstance(kind, type) and issubclass(annotation, kind)):
            return spark
    raise ReadModelMistake(f"no Spark type for {annotation!r}")


def _flat(metadata: typing.Iterable[Any]) -> list[Any]:
    """Annotated's metadata, a `Field(...)` in it given as its own constraints."""
    return [c for item in metadata for c in (getattr(item, "metadata", None) or [item])]


# Spark's decimals hold 38 digits at most; one of no declared precision is read with 20
# before the point and 18 after (a value past that fails its batch: `payload`). A field
# declared with pydantic's `max_digits` and `decimal_places` is read as exactly that.
DECIMAL_DIGITS_MAX = 38
DECIMAL_DEFAULT = DecimalType(DECIMAL_DIGITS_MAX, 18)


def _decimal_type(constraints: typing.Sequence[Any]) -> DataType:
    """The Spark decimal that holds every value pydantic lets through the field's
    `max_digits` and `decimal_places`; the text when no Spark decimal holds them all, to be
    cast by the read model itself."""
    digits = next((d for c in constraints if (d := getattr(c, "max_digits", None)) is not None), None)
    places = next((p for c in constraints if (p := getattr(c, "decimal_places", None)) is not None), None)
    if (digits or 0) > DECIMAL_DIGITS_MAX or (places or 0) > DECIMAL_DIGITS_MAX:
        return StringType()
    if digits is not None and places is not None:
        return DecimalType(digits, min(places, digits))
    if digits is not None:  # its digits on either side of the point: twice as many places, or the text
        return DecimalType(2 * digits, digits) if 2 * digits <= DECIMAL_DIGITS_MAX else StringType()
    if places is not None:
        return DecimalType(DECIMAL_DIGITS_MAX, places)
    return DECIMAL_DEFAULT


def _one_of(options: list[DataType], annotation: Any = None) -> DataType:
    """The one Spark type of a union's members: theirs if they share it, a double for
    numbers, else the JSON text. A fixed tuple's items (`annotation`) must share one."""
    distinct = list(dict.fromkeys(options))
    if len(distinct) == 1:
        return distinct[0]
    if annotation is not None:
        raise ReadModelMistake(f"no Spark type for {annotation!r}: its items differ in type (a JSON array's share one)")
    if set(distinct) <= {LongType(), DoubleType()}:
        return DoubleType()
    return StringType()


def spark_schema(model: type[BaseModel]) -> StructType:
    """The Spark struct of a pydantic model's fields; a field of no Spark type (an
    `IPv4Address`, a `tuple[int, str]`) as its JSON text, for a read model that needs it to
    parse with F.from_json and a type of its own: its other fields are read all the same."""
    decorators = model.__pydantic_decorators__
    # Fields written otherwise than their types say: read as their JSON text, as a FAILFAST
    # parse (`payload`) would fail every such event.
    serialized = {f for d in decorators.field_serializers.values() for f in d.info.fields}
    every_one = bool(decorators.model_serializers)
    temporal_otherwise = model.model_config.get("ser_json_temporal", "iso8601") != "iso8601"
    fields = []
    for name, field in model.model_fields.items():
        try:
            spark = spark_type(field.annotation, field.metadata)
        except ReadModelMistake:
            spark = StringType()
        if every_one or name in serialized or (temporal_otherwise and _holds_temporal(spark)):
            spark = StringType()
        fields.append(StructField(name, spark))
    return StructType(fields)


def _holds_temporal(spark: DataType) -> bool:
    """Whether `spark` is, or holds, a date or a timestamp (not a field that names one)."""
    if isinstance(spark, (TimestampType, DateType)):
        return True
    if isinstance(spark, ArrayType):
        return _holds_temporal(spark.elementType)
    if isinstance(spark, MapType):
        return _holds_temporal(spark.valueType)
    return isinstance(spark, StructType) and any(_holds_temporal(f.dataType) for f in spark.fields)


def _envelope_type(name: str, annotation: Any) -> DataType:
    if name == "schema_version":
        return IntegerType()  # not spark_type's bigint: the archive tables already written hold an int
    if typing.get_origin(annotation) is dict:
        return StringType()  # the raw JSON object: decoded per event type
    return spark_type(annotation)


# An event record's fields, as Spark reads them from the topic's JSON.
ENVELOPE = StructType([StructField(f.name, _envelope_type(f.name, f.type)) for f in msgspec.structs.fields(EventRecord)])


def ddl(schema: StructType) -> str:
    """`schema`'s columns as a DDL column list, e.g. "event_id string, version bigint"."""
    return ", ".join(f"{column.name} {column.dataType.simpleString()}" for column in schema.fields)


FETCH_MAX_WAIT_MS = 10


def kafka_source_options(settings: Settings) -> dict[str, str]:
    """Spark's Kafka source takes the Java consumer's settings with a `kafka.` prefix: the
    same ESK_KAFKA__* settings as esk's own clients, translated."""
    k = settings.kafka
    call_timeout_ms = min(settings.projections.kafka_call_timeout_ms, k.request_timeout_ms)
    options = {
        "kafka.bootstrap.servers": settings.bootstrap_servers,
        "kafka.isolation.level": "read_committed",
        # A task reads a fixed offset range. One that ends in a transaction's commit marker
        # (the processor's ranges all do) asks for one more fetch after its last record,
        # which the broker holds for fetch.max.wait.ms, 500 ms by default, as nothing
        # comes: a few tasks' worth of that on every micro-batch, however small.
        "kafka.fetch.max.wait.ms": str(FETCH_MAX_WAIT_MS),
        "kafka.security.protocol": k.security_protocol,
        # Both, or the Admin client refuses the second below the first.
        "kafka.request.timeout.ms": str(call_timeout_ms),
        "kafka.default.api.timeout.ms": str(call_timeout_ms),
        # Each try of the driver's offset lookup is as long as a call: as many tries as keep
        # the budget of Spark's default, three of esk's clients' request timeouts, after
        # which the query gives up (a broker away for that long: runner._outage_over).
        "fetchOffset.numRetries": str(max(3, math.ceil(3 * k.request_timeout_ms / call_timeout_ms))),
    }
    if k.security_protocol in ("SSL", "SASL_SSL"):
        options |= _java_tls_options(settings)
    if k.security_protocol.startswith("SASL"):
        # aiokafka's default mechanism; Java's would be GSSAPI (Kerberos).
        mechanism = k.sasl_mechanism or "PLAIN"
        options["kafka.sasl.mechanism"] = mechanism
        if mechanism == "PLAIN" or mechanism.startswith("SCRAM-"):
            module = "plain.PlainLoginModule" if mechanism == "PLAIN" else "scram.ScramLoginModule"
            options["kafka.sasl.jaas.config"] = (
                f"org.apache.kafka.common.security.{module} required "
                f"username={_jaas_quoted(k.sasl_plain_username or '')} password={_jaas_quoted(k.sasl_plain_password or '')};"
            )
    return options


def _java_tls_options(settings: Settings) -> dict[str, str]:
    k = settings.kafka
    options: dict[str, str] = {}
    if k.ssl_cafile:
        options |= {"kafka.ssl.truststore.type": "PEM", "kafka.ssl.truststore.location": k.ssl_cafile}
    if not k.ssl_check_hostname:
        options["kafka.ssl.endpoint.identification.algorithm"] = ""  # Java checks by default
    if k.ssl_certfile and k.ssl_keyfile:
        # The Java client's PEM keystore wants the key and the chain together; given as
        # two files (as aiokafka takes them), they go in as values.
        options |= {
            "kafka.ssl.keystore.type": "PEM",
            "kafka.ssl.keystore.certificate.chain": Path(k.ssl_certfile).read_text(),
            "kafka.ssl.keystore.key": _pkcs8_key(Path(k.ssl_keyfile), k.ssl_password),
        }
    return options


def _pkcs8_key(path: Path, password: str | None) -> str:
    """The client's key as Java's PEM keystore reads it: PKCS#8, not encrypted. Java 17 cannot
    decrypt a key encrypted as OpenSSL 3 does by default (PBES2: "PBES2 SecretKeyFactory not
    available"), and reads no traditional (PKCS#1, SEC1) key: decrypted here, it stays in the
    driver's memory and in the query's options, which Spark redacts in its plans (the
    session's `spark.sql.redaction.options.regex`)."""
    from cryptography.hazmat.primitives import serialization

    key = serialization.load_pem_private_key(path.read_bytes(), password.encode() if password else None)
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()).decode()


def _jaas_quoted(value: str) -> str:
    """A JAAS option value: in double quotes, with backslash escapes (Java reads it with a
    StreamTokenizer)."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def event_stream(spark: SparkSession, settings: Settings, categories: tuple[str, ...], batch_max: int | None = None) -> DataFrame:
    """The categories' event records as Spark's Kafka source reads them: what `decode` needs
    (value, partition, offset) and no more, as a batch of them is cached whole; `batch_max`
    events a batch at most, unless ESK_PROJECTIONS__MAX_OFFSETS_PER_TRIGGER is set."""
    topics = TopicNames(settings.app)
    reader = (
        spark.readStream.format("kafka")
        .options(**kafka_source_options(settings))
        .option("subscribe", ",".join(topics.events(c) for c in categories))
        .option("startingOffsets", "earliest")
        .option("failOnDataLoss", "false")
    )
    if most := settings.projections.max_offsets_per_trigger or batch_max:
        reader = reader.option("maxOffsetsPerTrigger", str(most))
    return reader.load().select("value", "partition", "offset")


def decode(raw: DataFrame) -> DataFrame:
    """Kafka records -> one row per event: the envelope's columns, `event_time` and `day`,
    plus the source partition and offset. `data` is as written: see `upcast`."""
    # Parsed once a row: a read model's filter on a decoded column (`of(orders)`, say) would
    # otherwise be pushed below the parse by Spark's optimizer, as a second parse of the
    # whole record for that one field. A non-deterministic condition (always true) keeps
    # filters above it.
    envelope = F.when(F.spark_partition_id() >= 0, F.from_json(F.col("value").cast("string"), ENVELOPE))
    events = raw.select(
        envelope.alias("e"),
        F.col("partition").alias("kafka_partition"),
        F.col("offset").alias("kafka_offset"),
    ).select("e.*", "kafka_partition", "kafka_offset")
    return events.withColumns(
        {
            "event_time": F.timestamp_millis(F.col("recorded_at")),
            "day": F.to_date(F.timestamp_millis(F.col("recorded_at"))),
        }
    )


def no_events(spark: SparkSession) -> DataFrame:
    """An empty batch, decoded: what a read model is given, with no rows."""
    return decode(spark.createDataFrame([], "value binary, partition int, offset bigint"))


def upcast(events: DataFrame, settings: Settings, categories: tuple[str, ...]) -> DataFrame:
    """`events` (one micro-batch, decoded from its cached records) with `data` brought to
    each event type's current schema version by the domain's own upcasters. A Python UDF
    is evaluated for every row of its input, even under F.when, so only the rows of an
    older version go through it: they are split off, upcast, and put back."""
    older = older_version(settings, categories)
    if older is None:
        return events
    upcast_data = _upcast_udf(settings.domain)("aggregate_type", "type", "schema_version", "data")
    return events.filter(~older).unionByName(events.filter(older).withColumn("data", upcast_data))


def older_version(settings: Settings, categories: tuple[str, ...]) -> Column | None:
    """True on the rows of an event type's older schema version; None when no type read
    has upcasters. A batch with no such row needs no `upcast`, whose UDF would start
    Python workers for nothing."""
    registry = load_registry(settings.domain)
    if not any(registry[name].upcasters for name in categories):
        return None
    return _older(registry, categories)


def _older(registry: Registry, categories: tuple[str, ...]) -> Column:
    return F.col("schema_version") < _current_version(registry, categories)


def newer_version(settings: Settings, categories: tuple[str, ...]) -> Column:
    """True on the rows written by newer code (a processor released before the read
    models), which this code would read wrongly: an event type's schema version newer than
    the code's (its new fields null, its renamed ones missing), or a type of one of
    `categories` the code does not know (no type is ever removed: the schema check refuses
    it), whose rows a read model of this code would leave out for good."""
    current = _current_version(load_registry(settings.domain), categories)
    unknown = current.isNull() & F.col("type").isNotNull() & F.col("aggregate_type").isin(*categories)
    return F.coalesce(F.col("schema_version") > current, unknown)


def _current_version(registry: Registry, categories: tuple[str, ...]) -> Column:
    """The code's schema version of each row's event type."""
    current = {
        f"{name}/{event.type_name()}": event.schema_version
        for name in categories
        for event in registry[name].events
    }
    current_version = F.create_map(*[x for k, v in current.items() for x in (F.lit(k), F.lit(v))])
    return current_version[F.concat_ws("/", "aggregate_type", "type")]


def _upcast_udf(domain: str) -> Any:
    @F.udf(StringType())
    def upcast_data(aggregate_type: str, type_name: str, schema_version: int, data: str) -> str:
        aggregate = _worker_registry(domain)[aggregate_type]
        return orjson.dumps(aggregate.current_payload(type_name, schema_version, orjson.loads(data))).decode()

    return upcast_data


# The aggregate types the read model whose batch is being planned reads (`reading`): its
# batches hold their events and no others, so a filter on another type's would find none.
_READ: ContextVar[tuple[str, tuple[AggregateType[Any], ...]] | None] = ContextVar("esk_read_model_reads", default=None)


@contextmanager
def reading(name: str, reads: tuple[AggregateType[Any], ...]) -> Iterator[None]:
    """While a read model's batch is planned: `of`, `is_event` and `payload` then refuse
    an aggregate type it does not read."""
    token = _READ.set((name, reads))
    try:
        yield
    finally:
        _READ.reset(token)


def _read_here(aggregate_type: AggregateType[Any]) -> None:
    read = _READ.get()
    if read is not None and aggregate_type not in read[1]:
        name, reads = read
        raise ReadModelMistake(
            f"{name} reads {', '.join(a.name for a in reads)}, not {aggregate_type.name}: its batches hold none of "
            f"{aggregate_type.name}'s events (add {aggregate_type.name} to its ReadModel's reads)"
        )


def is_event(aggregate_type: AggregateType[Any], event: type[Event]) -> Column:
    """True on the rows of `event` (of `aggregate_type`: names may repeat across types)."""
    if event not in aggregate_type.events:
        raise ReadModelMistake(f"{event.__name__} is not an event of {aggregate_type.name}")
    _read_here(aggregate_type)
    return (F.col("aggregate_type") == aggregate_type.name) & (F.col("type") == event.type_name())


def payload(aggregate_type: AggregateType[Any], event: type[Event]) -> Column:
    """The decoded payload of `event`'s rows, as a struct of its fields; null on other rows.
    A value its field's Spark type cannot hold (a number past a bigint or a decimal's
    precision) fails the batch, which parks its aggregate: Spark would read it as null,
    and the read model's rows would be wrong with nothing told."""
    return F.when(is_event(aggregate_type, event), F.from_json(F.col("data"), spark_schema(event), {"mode": "FAILFAST"}))


def of(aggregate_type: AggregateType[Any]) -> Column:
    """True on the rows of `aggregate_type`'s events."""
    _read_here(aggregate_type)
    return F.col("aggregate_type") == aggregate_type.name


@lru_cache(maxsize=4)
def _worker_registry(domain: str) -> Registry:
    return load_registry(domain)
