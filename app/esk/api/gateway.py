"""Puts commands on `<app>.commands`, keyed by aggregate, and only then acknowledges them.

The producer is idempotent with acks=all: once `submit` returns, the command is durably
in the log and its outcome will be produced whatever crashes next (G4).
"""

from __future__ import annotations

from aiokafka import AIOKafkaProducer
from opentelemetry.trace import SpanKind

from .. import tracing
from ..kafka.client_options import client_options
from ..kafka.topics import TopicNames
from ..protocol import CommandEnvelope
from ..settings import Settings


class CommandGateway:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.topic = TopicNames(settings.app).commands
        self._producer: AIOKafkaProducer | None = None
        self._traced = settings.tracing.enabled

    async def start(self) -> None:
        # aiokafka clients bind to the running loop, so they are made here, not in __init__.
        self._producer = AIOKafkaProducer(
            **client_options(self.settings),
            client_id=f"{self.settings.app}.api",
            acks="all",
            enable_idempotence=True,
            linger_ms=1,
        )
        await self._producer.start()

    async def stop(self) -> None:
        if self._producer is not None:
            await self._producer.stop()

    async def submit(self, envelope: CommandEnvelope) -> None:
        assert self._producer is not None, "CommandGateway.start() was not awaited"
        if not self._traced:
            await self._producer.send_and_wait(self.topic, envelope.encode(), key=envelope.key)
            return
        # A child of the request's span; the processor's handling becomes a child of this one.
        with tracing.TRACER.start_as_current_span(
            f"send {envelope.aggregate_type}.{envelope.command}",
            kind=SpanKind.PRODUCER,
            attributes={**tracing.command_attributes(envelope, self.topic), "messaging.operation.type": "send"},
        ) as span:
            headers = tracing.headers_for(span)
            await self._producer.send_and_wait(self.topic, envelope.encode(), key=envelope.key, headers=headers)
