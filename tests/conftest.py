"""The suite starts one real Kafka broker (KRaft, its jars from esk's jar cache) on free ports and
stops it at the end. Each test that needs topics gets an application name of its own. Tests that
ask for `postgres_dsn` get a database of their own on a real PostgreSQL server the suite starts
(on first use only) and stops the same way."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from esk.broker import EmbeddedBroker
from esk.broker.ports import free_port_pair
from esk.settings import BrokerSettings, Settings
from tests.postgres import PostgresServer


@pytest.fixture(scope="session")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedBroker]:
    settings = BrokerSettings(port=free_port_pair(), data_dir=tmp_path_factory.mktemp("broker"))
    embedded = EmbeddedBroker(settings)
    embedded.start()
    yield embedded
    embedded.stop()


@pytest.fixture
def settings(broker: EmbeddedBroker, tmp_path: Path) -> Settings:
    """Settings for one test: its own app name (so its own topics) and state directories."""
    return own_settings(broker, tmp_path)


def own_settings(broker: EmbeddedBroker, directory: Path) -> Settings:
    """Settings of their own (an app name, so topics, and state directories under
    `directory`): a test's, or those of a module's tests that share one system."""
    return Settings(
        app=f"t{uuid.uuid4().hex[:10]}",
        kafka={"bootstrap_servers": broker.bootstrap},
        broker=broker.settings.model_dump(),
        topics={"partitions": 3},
        processor={"state_dir": directory / "processor", "commit_interval_ms": 20},
        api={"state_dir": directory / "api", "port": 0},
        _env_file=None,
    )


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresServer]:
    """The suite's PostgreSQL server; started by the first test that asks for it, so a run
    without such tests never pays for initdb."""
    server = PostgresServer()
    server.start()
    yield server
    server.stop()


@pytest.fixture
def postgres_dsn(postgres: PostgresServer) -> Iterator[str]:
    """A fresh database for one test, dropped after it: tests share the server, never tables."""
    name = f"t_{uuid.uuid4().hex}"
    dsn = postgres.create_database(name)
    yield dsn
    postgres.drop_database(name)
