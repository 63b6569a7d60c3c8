"""Puts commands on `<app>.commands`, keyed by aggregate, and only then acknowledges them.

The producer is idempotent with acks=all: once `submit` returns, the command is durably
in the log and its outcome will be produced whatever crashes next (G4).
"""

from __future__ import annotations

from aiokafka import AIOKafkaProducer

from app.kafka.client_options import client_options
from app.kafka.topics import TopicNames
from app.protocol import CommandEnvelope
from app.settings import Settings


class CommandGateway:
    def __init__(self, settings: Settings) -> None:
        self.topic = TopicNames(settings.app).commands
        self._producer = AIOKafkaProducer(
            **client_options(settings),
            client_id=f"{settings.app}.api",
            acks="all",
            enable_idempotence=True,
            linger_ms=1,
        )

    async def start(self) -> None:
        await self._producer.start()

    async def stop(self) -> None:
        await self._producer.stop()

    async def submit(self, envelope: CommandEnvelope) -> None:
        await self._producer.send_and_wait(self.topic, envelope.encode(), key=envelope.key)
