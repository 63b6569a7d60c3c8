"""Puts commands on `<app>.commands`, keyed by aggregate, and only then acknowledges them.

The producer is idempotent with acks=all: once `submit` returns, the command is durably
in the log and its outcome will be produced whatever crashes next (G4).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError
from opentelemetry.trace import SpanKind

from .. import tracing
from ..kafka.client_options import client_options
from ..kafka.topics import TopicNames
from ..protocol import CommandEnvelope
from ..settings import Settings

log = logging.getLogger(__name__)


class CommandGateway:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.topic = TopicNames(settings.app).commands
        self._producer: AIOKafkaProducer | None = None
        self._traced = settings.tracing.enabled
        self._starting = asyncio.Lock()

    async def start(self) -> None:
        await self._current()

    async def stop(self) -> None:
        if self._producer is not None:
            await self._producer.stop()
            self._producer = None

    async def _current(self) -> AIOKafkaProducer:
        """The producer, started first when there is none (at the start, or after one that
        an error stopped for good)."""
        async with self._starting:
            if self._producer is not None:
                return self._producer
            # aiokafka clients bind to the running loop, so they are made here, not in __init__.
            producer = AIOKafkaProducer(
                **client_options(self.settings),
                client_id=f"{self.settings.app}.api",
                acks="all",
                enable_idempotence=True,
                linger_ms=1,
            )
            await producer.start()
            self._producer = producer
            return producer

    async def submit(self, envelope: CommandEnvelope) -> None:
        producer = await self._current()
        try:
            await self._send(producer, envelope)
        except KafkaError as error:
            # An idempotent producer's sender ends on an error it cannot retry (a sequence
            # number out of order after a broker came back, say) and fails every send after
            # it: a new one takes over. Nothing it was sending was acknowledged, so nothing
            # is lost: those requests are answered 503 and retried under their keys.
            if not error.retriable:
                await self._retire(producer, error)
            raise

    async def _retire(self, failed: AIOKafkaProducer, error: KafkaError) -> None:
        if self._producer is failed:  # not retired by another request already
            log.warning("the API's producer failed (%r): a new one takes over", error)
            self._producer = None
        with contextlib.suppress(Exception):
            await failed.stop()

    async def _send(self, producer: AIOKafkaProducer, envelope: CommandEnvelope) -> None:
        if not self._traced:
            await producer.send_and_wait(self.topic, envelope.encode(), key=envelope.key)
            return
        # A child of the request's span; the processor's handling becomes a child of this one.
        with tracing.TRACER.start_as_current_span(
            f"send {envelope.aggregate_type}.{envelope.command}",
            kind=SpanKind.PRODUCER,
            attributes={**tracing.command_attributes(envelope, self.topic), "messaging.operation.type": "send"},
        ) as span:
            headers = tracing.headers_for(span)
            await producer.send_and_wait(self.topic, envelope.encode(), key=envelope.key, headers=headers)
