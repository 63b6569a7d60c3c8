"""Puts commands on `<app>.commands`, keyed by aggregate, and only then acknowledges them.

The producer is idempotent with acks=all: once `submit` returns, the command is durably
in the log and its outcome will be produced whatever crashes next (G4).

A command not acknowledged within `ESK_API__SUBMIT_TIMEOUT_S` fails (its record may still
be stored later, as the producer goes on retrying it: the client retries under its key,
which never applies a command twice). After such a failure for want of a broker, every
command fails at once (`KafkaAway`) until a broker answers again, which the gateway asks
every PROBE_INTERVAL_S: a client told 503 in milliseconds retries under its key, rather
than holding a connection for the timeout and then retrying all the same. A broker that
answers may still store nothing (its partitions below `min.insync.replicas`, a cluster
without its controllers' quorum): the next command then tries alone, the others refused
at once meanwhile, and only a command stored ends the outage.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError, OutOfOrderSequenceNumber
from opentelemetry.trace import SpanKind

from .. import tracing
from ..kafka.client_options import check_access, client_options
from ..kafka.errors import broker_away
from ..kafka.topics import TopicNames
from ..metrics import API_KAFKA_AWAY
from ..protocol import CommandEnvelope
from ..settings import Settings

log = logging.getLogger(__name__)

PROBE_INTERVAL_S = 1.0


class KafkaAway(Exception):
    """Not tried: a command found no broker, and none has answered since."""

    def __init__(self, since: float) -> None:
        self.since = since  # time.time() of the failure that found none
        super().__init__(f"no Kafka broker has stored a command since {time.strftime('%H:%M:%S', time.localtime(since))}")


class CommandGateway:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.topic = TopicNames(settings.app).commands
        self._producer: AIOKafkaProducer | None = None
        self._traced = settings.tracing.enabled
        self._starting = asyncio.Lock()
        self._away_since: float | None = None
        self._probe: asyncio.Task[None] | None = None  # asks whether a broker is back, while none is
        self._trying = False  # a broker answers again, and a command tries whether commands are stored
        self._discarding: set[asyncio.Task[None]] = set()  # producers whose start failed, stopping

    async def start(self) -> None:
        await self._current()

    async def stop(self) -> None:
        probe = self._probe
        self._back()  # cancels the probe
        if probe is not None:
            await asyncio.gather(probe, return_exceptions=True)
        if self._producer is not None:
            producer, self._producer = self._producer, None
            await self._discard(producer)

    async def _discard(self, producer: AIOKafkaProducer) -> None:
        """Stops `producer`, bounded: its stop sends what it holds first (records of
        commands answered 503, timed out), which it would retry for as long as no broker
        answers; then its connections and tasks go with its client."""
        try:
            async with asyncio.timeout(self.settings.api.submit_timeout_s):
                await producer.stop()
        except Exception as error:  # timed out, or a start cut short: its client still goes
            log.debug("the API's producer did not stop cleanly: %r", error)
            if producer._sender.sender_task is not None:  # else left pending, and told as destroyed so
                producer._sender.sender_task.cancel()
            with contextlib.suppress(Exception):
                await producer.client.close()

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
            try:
                await producer.start()  # an idempotent one asks for its id until a broker answers
            except BaseException:  # failed, or cut short by the command's timeout
                discarding = asyncio.get_running_loop().create_task(self._discard(producer))
                self._discarding.add(discarding)
                discarding.add_done_callback(self._discarding.discard)
                raise
            self._producer = producer
            return producer

    def commands_partitions(self) -> int | None:
        """How many partitions the commands topic has, as the producer knows it (it puts
        each command on one by its key); None while it does not know yet."""
        producer = self._producer
        partitions = producer.client.cluster.partitions_for_topic(self.topic) if producer is not None else None
        return len(partitions) if partitions else None

    @property
    def away_since(self) -> float | None:
        """time.time() of the failure that found no broker, while none has answered since."""
        return self._away_since

    async def submit(self, envelope: CommandEnvelope) -> None:
        """Raises KafkaAway, untried, while no broker has answered since a command found
        none, or while another command tries whether commands are stored again."""
        trying = False
        if self._away_since is not None:
            if self._trying or (self._probe is not None and not self._probe.done()):
                raise KafkaAway(self._away_since)
            self._trying = trying = True
        try:
            async with asyncio.timeout(self.settings.api.submit_timeout_s):  # no task of its own, unlike wait_for
                await self._submit(envelope)
        except (KafkaError, TimeoutError) as error:
            if broker_away(error):
                self._note_away(error)
            raise
        finally:
            if trying:
                self._trying = False
        if self._away_since is not None:  # stored: a command in flight got through, or the one that tried
            log.info("a command was stored: commands are taken again (none was for %.0f s)", time.time() - self._away_since)
            self._back()

    async def _submit(self, envelope: CommandEnvelope) -> None:
        """An idempotent producer's sender ends on an error it cannot retry and fails every
        send after it: a new one takes over. Nothing it was sending was acknowledged, so
        nothing is lost. The one error of that kind a broker back from an outage gives (a
        sequence number out of order: the producer gave up records it held through it) is
        no command's: the command is sent again, by the new producer."""
        for again in (True, False):
            producer = await self._current()
            try:
                await self._send(producer, envelope)
                return
            except KafkaError as error:
                if broker_away(error):
                    raise
                await self._retire(producer, error)
                if not (again and isinstance(error, OutOfOrderSequenceNumber)):
                    raise

    def _note_away(self, error: KafkaError | TimeoutError) -> None:
        if self._away_since is None:
            self._away_since = time.time()
            API_KAFKA_AWAY.set(1)
            log.warning(
                "a command was not stored (%r: no broker answered, or its partition had no leader or too few in-sync "
                "replicas in time): commands are refused at once until one is stored again",
                error,
            )
        elif self._probe is None or self._probe.done():  # a broker answers, and stores nothing all the same
            log.debug("a command was not stored while a broker answers: %r", error)
        else:
            return
        self._probe = asyncio.create_task(self._until_a_broker_answers(), name="kafka-probe")

    async def _until_a_broker_answers(self) -> None:
        while True:
            await asyncio.sleep(PROBE_INTERVAL_S)
            try:
                async with asyncio.timeout(self.settings.api.submit_timeout_s):
                    answered = await check_access(self.settings)
            except Exception as error:  # refused (TLS, SASL) or no answer in time: still away
                log.debug("no Kafka broker answers yet: %r", error)
                continue
            if answered:
                break
        # The next command tries (submit): a broker that answers may still store nothing.
        log.debug("a Kafka broker answers again: the next command tries whether commands are stored")

    def _back(self) -> None:
        if self._probe is not None and self._probe is not asyncio.current_task():
            self._probe.cancel()
        self._probe = None
        self._away_since = None
        self._trying = False
        API_KAFKA_AWAY.set(0)

    async def _retire(self, failed: AIOKafkaProducer, error: KafkaError | TimeoutError) -> None:
        if self._producer is failed:  # not retired by another request already
            # what a broker back from an outage gives a producer that held records through it: expected
            level = logging.INFO if isinstance(error, OutOfOrderSequenceNumber) else logging.WARNING
            log.log(level, "the API's producer failed (%r): a new one takes over", error)
            self._producer = None
        await self._discard(failed)

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
