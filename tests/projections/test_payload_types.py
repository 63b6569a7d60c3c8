"""An event's fields as `payload` reads them: the Spark type of each pydantic annotation
(projections/events.py `spark_type`), and the values Spark's from_json reads back from the
JSON pydantic writes, as the processor writes events."""

from __future__ import annotations

import datetime
import decimal
import enum
import ipaddress
import uuid
from typing import Annotated, Any, Literal

import orjson
import pytest
from pydantic import BaseModel, ConfigDict, Field, PlainSerializer, field_serializer

pytest.importorskip("pyspark")

from pyspark.sql import functions as F
from pyspark.sql.types import (
    ArrayType,
    BooleanType,
    DateType,
    DecimalType,
    DoubleType,
    LongType,
    MapType,
    StringType,
    TimestampType,
)

from esk.projections.catalog import ReadModelMistake
from esk.projections.events import spark_schema, spark_type


class Shelf(enum.StrEnum):
    TOP = "top"
    LOW = "low"


class Priority(enum.IntEnum):
    LOW = 1
    HIGH = 2


class Line(BaseModel):
    sku: str
    qty: int


class Borrowed(BaseModel):
    due: datetime.date
    at: datetime.datetime
    fee: decimal.Decimal
    loan: uuid.UUID
    shelf: Shelf
    priority: Priority
    counts: dict[str, int]
    spot: tuple[int, int]
    tags: set[str]
    lines: list[Line]
    note: str | None = None
    code: int | str = 0
    weight: int | float = 0
    kind: Literal["a", "b"] = "a"
    size: Annotated[int, Field(ge=0)] = 0
    extra: Any = None


@pytest.mark.parametrize(
    ("annotation", "spark"),
    [
        (bool, BooleanType()), (int, LongType()), (float, DoubleType()), (str, StringType()),
        (datetime.date, DateType()), (datetime.datetime, TimestampType()), (decimal.Decimal, DecimalType(38, 18)),
        (uuid.UUID, StringType()), (Shelf, StringType()), (Priority, LongType()),
        (dict[str, int], MapType(StringType(), LongType())), (tuple[int, int], ArrayType(LongType())),
        (tuple[str, ...], ArrayType(StringType())), (set[str], ArrayType(StringType())),
        (str | None, StringType()), (int | str, StringType()), (int | float, DoubleType()),
        (Literal["a", "b"], StringType()), (Literal[1, 2], LongType()), (Annotated[int, Field(ge=0)], LongType()),
    ],
)
def test_each_annotation_has_its_spark_type(annotation: Any, spark: Any) -> None:
    assert spark_type(annotation) == spark


class Priced(BaseModel):
    price: decimal.Decimal = Field(max_digits=12, decimal_places=2)
    rate: Annotated[decimal.Decimal, Field(max_digits=10, decimal_places=6)]
    huge: decimal.Decimal = Field(max_digits=30, decimal_places=8)  # 22 digits before the point: past decimal(38, 18)
    either: decimal.Decimal = Field(max_digits=12)  # its 12 digits on either side of the point
    long: decimal.Decimal = Field(max_digits=20)  # 40 places would hold them: more than Spark's 38
    places: decimal.Decimal = Field(decimal_places=4)
    wide: decimal.Decimal = Field(max_digits=50)  # no Spark decimal holds it
    fees: list[Annotated[decimal.Decimal, Field(max_digits=5, decimal_places=2)]] = []
    refund: decimal.Decimal | None = Field(default=None, max_digits=9, decimal_places=2)
    plain: decimal.Decimal = decimal.Decimal(0)


def test_a_decimal_is_read_with_the_precision_its_field_declares() -> None:
    assert [(f.name, f.dataType) for f in spark_schema(Priced).fields] == [
        ("price", DecimalType(12, 2)),
        ("rate", DecimalType(10, 6)),
        ("huge", DecimalType(30, 8)),
        ("either", DecimalType(24, 12)),
        ("long", StringType()),
        ("places", DecimalType(38, 4)),
        ("wide", StringType()),
        ("fees", ArrayType(DecimalType(5, 2))),
        ("refund", DecimalType(9, 2)),
        ("plain", DecimalType(38, 18)),
    ]


@pytest.mark.spark
def test_spark_reads_back_every_decimal_its_field_lets_through(spark: Any) -> None:
    big = "9" * 22 + ".12345678"
    event = Priced(price=decimal.Decimal("9999999999.99"), rate=decimal.Decimal("0.000125"), huge=decimal.Decimal(big),
                   either=decimal.Decimal("0.123456789012"), long=decimal.Decimal("1.5"),
                   places=decimal.Decimal("123456789012345678901234567890.1234"), wide=decimal.Decimal("1" * 45),
                   fees=[decimal.Decimal("999.99")], refund=decimal.Decimal("0.50"))
    data = orjson.dumps(event.model_dump(mode="json")).decode()
    [row] = spark.createDataFrame([(data,)], "data string").select(F.from_json("data", spark_schema(Priced)).alias("p")).collect()
    read = row["p"].asDict(recursive=True)
    assert (read["price"], read["rate"], read["huge"]) == (decimal.Decimal("9999999999.99"), decimal.Decimal("0.000125"), decimal.Decimal(big))
    assert read["places"] == decimal.Decimal("123456789012345678901234567890.1234")
    assert (read["either"], read["long"]) == (decimal.Decimal("0.123456789012"), "1.5")
    assert (read["wide"], read["fees"], read["refund"]) == ("1" * 45, [decimal.Decimal("999.99")], decimal.Decimal("0.50"))


class Edit(BaseModel):
    updated_by: str


class Serialized(BaseModel):
    """Fields pydantic writes otherwise than their types would be: a big id as a string, a
    field serializer's, a time in milliseconds."""

    model_config = ConfigDict(ser_json_temporal="milliseconds")
    id: Annotated[int, PlainSerializer(str, return_type=str)]
    ids: list[Annotated[int, PlainSerializer(str, return_type=str)]] = []
    cents: int = 0
    at: datetime.datetime = datetime.datetime(2025, 1, 1)
    count: int = 0
    edit: Edit | None = None  # holds no date, though a field's name says one: read as its struct

    @field_serializer("cents")
    def _as_text(self, value: int) -> str:
        return f"{value} cents"


def test_fields_written_otherwise_than_their_types_are_read_as_their_json_text() -> None:
    assert [(f.name, f.dataType) for f in spark_schema(Serialized).fields] == [
        ("id", StringType()), ("ids", ArrayType(StringType())), ("cents", StringType()), ("at", StringType()), ("count", LongType()),
        ("edit", spark_schema(Edit)),
    ]


@pytest.mark.spark
def test_spark_reads_back_fields_written_otherwise_without_failing_the_batch(spark: Any) -> None:
    data = Serialized(id=2**62, ids=[7], cents=5, count=3).model_dump_json()  # as the processor writes it
    [row] = spark.createDataFrame([(data,)], "data string").select(
        F.from_json("data", spark_schema(Serialized), {"mode": "FAILFAST"}).alias("p")  # as `payload` reads it
    ).collect()
    read = row["p"].asDict()
    assert float(read.pop("at")) == 1735689600000.0  # a number's text as Spark writes it (1.7356896E12)
    assert read == {"id": str(2**62), "ids": ["7"], "cents": "5 cents", "count": 3, "edit": None}


def test_a_field_of_no_spark_type_is_read_as_its_json_text_and_the_others_as_theirs() -> None:
    """A read model that never reads an event's odd field still reads the others (the
    whole event could not be read for it before)."""

    class Odd(BaseModel):
        pair: tuple[int, str]
        address: ipaddress.IPv4Address
        count: int

    assert [(f.name, f.dataType) for f in spark_schema(Odd).fields] == [
        ("pair", StringType()), ("address", StringType()), ("count", LongType())
    ]
    with pytest.raises(ReadModelMistake, match=r"^no Spark type for tuple\[int, str\]: its items differ in type"):
        spark_type(tuple[int, str])
    with pytest.raises(ReadModelMistake, match="no Spark type for <class 'object'>"):
        spark_type(object)


@pytest.mark.spark
def test_spark_reads_back_what_pydantic_writes(spark: Any) -> None:
    event = Borrowed(
        due=datetime.date(2025, 6, 1),
        at=datetime.datetime(2025, 6, 1, 9, 30, 15, 123456, tzinfo=datetime.timezone(datetime.timedelta(hours=2))),
        fee=decimal.Decimal("1.50"),
        loan=uuid.UUID("12345678-1234-5678-1234-567812345678"),
        shelf=Shelf.LOW,
        priority=Priority.HIGH,
        counts={"a": 1},
        spot=(3, 4),
        tags={"x"},
        lines=[Line(sku="s", qty=2)],
        note=None,
        code="c7",
        weight=2.5,
        kind="b",
        size=3,
        extra={"any": [1]},
    )
    data = orjson.dumps(event.model_dump(mode="json")).decode()  # as the processor writes it
    [row] = spark.createDataFrame([(data,)], "data string").select(F.from_json("data", spark_schema(Borrowed)).alias("p")).collect()
    read = row["p"].asDict(recursive=True)
    assert read["due"] == datetime.date(2025, 6, 1)
    assert read["at"].astimezone(datetime.UTC) == event.at.astimezone(datetime.UTC)  # to the microsecond
    assert read["fee"] == decimal.Decimal("1.50")
    assert (read["loan"], read["shelf"], read["priority"]) == ("12345678-1234-5678-1234-567812345678", "low", 2)
    assert (read["counts"], read["spot"], read["tags"], read["lines"]) == ({"a": 1}, [3, 4], ["x"], [{"sku": "s", "qty": 2}])
    assert (read["note"], read["code"], read["weight"], read["kind"], read["size"]) == (None, "c7", 2.5, "b", 3)
    assert orjson.loads(read["extra"]) == {"any": [1]}
