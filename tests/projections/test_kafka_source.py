"""The options esk gives Spark's Kafka source (no Spark started, no broker)."""

from __future__ import annotations

import pytest

from esk.settings import Settings

pytest.importorskip("pyspark")

from esk.projections.events import kafka_source_options


def _timeouts(options: dict[str, str]) -> tuple[int, int, int]:
    return int(options["kafka.request.timeout.ms"]), int(options["kafka.default.api.timeout.ms"]), int(options["fetchOffset.numRetries"])


def test_spark_s_kafka_calls_time_out_sooner_than_esk_s_and_are_tried_as_long_in_all() -> None:
    """The driver's Admin client holds an offset lookup on a broker that died until the
    call times out: 5 s, not esk's clients' 30 s, and tried again for as long in all as
    Spark's three tries of 30 s were (the query gives up on a broker away after that)."""
    assert _timeouts(kafka_source_options(Settings(_env_file=None))) == (5_000, 5_000, 18)
    shorter = Settings(kafka={"request_timeout_ms": 2_000}, _env_file=None)  # never longer than esk's own
    assert _timeouts(kafka_source_options(shorter)) == (2_000, 2_000, 3)
    longer = Settings(projections={"kafka_call_timeout_ms": 10_000}, _env_file=None)
    assert _timeouts(kafka_source_options(longer)) == (10_000, 10_000, 9)
