"""The suite starts one real Kafka broker (KRaft, its jars from esk's jar cache) on free ports and
stops it at the end. Each test that needs topics gets an application name of its own."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from esk.broker import EmbeddedBroker
from esk.broker.ports import free_port_pair
from esk.settings import BrokerSettings, Settings


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
    return Settings(
        app=f"t{uuid.uuid4().hex[:10]}",
        kafka={"bootstrap_servers": broker.bootstrap},
        broker=broker.settings.model_dump(),
        topics={"partitions": 3},
        processor={"state_dir": tmp_path / "processor", "commit_interval_ms": 20},
        api={"state_dir": tmp_path / "api", "port": 0},
        _env_file=None,
    )
