"""The Spark session of a test module that asks for one: its own, stopped when the module
ends (pyspark is imported here only then, as some modules of this folder run without it)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


@pytest.fixture(scope="module")
def spark(request: pytest.FixtureRequest) -> Iterator[SparkSession]:
    from esk.projections.session import spark_session
    from esk.settings import Settings

    session = spark_session(Settings(_env_file=None), f"esk-{request.module.__name__.rpartition('.')[2]}")
    yield session
    session.stop()


@pytest.fixture
def runner_said(caplog: pytest.LogCaptureFixture) -> Callable[[], str]:
    """What the read-model runner has logged (its messages, a line each) since the test began."""
    caplog.set_level(logging.INFO, logger="esk.projections.runner")
    return lambda: "\n".join(record.getMessage() for record in caplog.records if record.name == "esk.projections.runner")
