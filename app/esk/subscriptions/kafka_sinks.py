"""The sinks of the kinds whose offsets live in Kafka: a Reactor's (exactly once, in Kafka
transactions) and a SideEffectHandler's (at least once).

A Reactor's input partition has a transactional producer of its own with a stable id,
`<group>.<topic>.<partition>`, as each commands partition of the processor does (aiokafka
speaks the transaction protocol from before KIP-447: fencing rests on the id alone).
`open` runs init_transactions first, which fences the previous owner and settles whatever
it left open, and only then reads the group's committed offset, so it sees that owner's
last commit. A unit's commands, its parked events and the offset are one transaction.
"""

from __future__ import annotations

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.errors import CommitFailedError, IllegalStateError, ProducerFenced

from .. import tracing
from ..processing.record_collector import Output
from ..processing.streams_producer import StreamsProducer
from ..protocol import position
from ..settings import Settings
from .api import AnySubscription
from .parked_topic import ParkedTopic, parked_key
from .parking import ParkedEvent
from .routing import Delivery, Router, call_handler, command_envelope, reactor_commands
from .sinks import Fenced, PartitionSink, StartingPoint, Unit


async def starting_point(consumer: AIOKafkaConsumer, parked_topic: ParkedTopic, tp: TopicPartition) -> StartingPoint:
    """The group's committed offset, and what the parked topic says of the partition."""
    committed = await consumer.committed(tp)
    state = await parked_topic.refresh(parked_topic.partition_of(tp.partition))
    parked = ((e.aggregate_id, e.offset, e.reason) for e in state.still_parked(tp.topic, tp.partition))
    return StartingPoint.of(committed, state.replay_until.get((tp.topic, tp.partition), 0), parked)


async def parked_in_topic(parked_topic: ParkedTopic, tp: TopicPartition, aggregate_id: str) -> list[ParkedEvent]:
    state = await parked_topic.refresh(parked_topic.partition_of(tp.partition))
    return [e for e in state.still_parked(tp.topic, tp.partition) if e.aggregate_id == aggregate_id]


async def entry_in_topic(parked_topic: ParkedTopic, tp: TopicPartition, offset: int) -> ParkedEvent | None:
    state = await parked_topic.refresh(parked_topic.partition_of(tp.partition))
    return state.parked.get(position(tp.topic, tp.partition, offset))


def parked_output(parked_topic: ParkedTopic, event: ParkedEvent) -> Output:
    return Output(parked_topic.topic, parked_key(event), event.encode(), partition=parked_topic.partition_of(event.partition))


def transactional_id(group_id: str, tp: TopicPartition) -> str:
    return f"{group_id}.{tp.topic}.{tp.partition}"


class TransactionalSink(PartitionSink):
    """A Reactor's input partition."""

    def __init__(
        self,
        settings: Settings,
        subscription: AnySubscription,
        router: Router,
        consumer: AIOKafkaConsumer,
        parked_topic: ParkedTopic,
        group_id: str,
        tp: TopicPartition,
    ) -> None:
        self.subscription = subscription
        self.router = router
        self.consumer = consumer
        self.parked_topic = parked_topic
        self.group_id = group_id
        self.tp = tp
        self.producer = StreamsProducer(settings, transactional_id(group_id, tp), client_id=f"{group_id}-{tp.topic}-{tp.partition}")
        self.traced = settings.tracing.enabled

    async def open(self) -> StartingPoint:
        await self.producer.start()  # fencing first: the committed offset is read after it
        return await starting_point(self.consumer, self.parked_topic, self.tp)

    async def begin(self) -> Unit:
        return TransactionalUnit(self)

    async def close(self) -> None:
        await self.producer.stop()


class TransactionalUnit(Unit):
    def __init__(self, sink: TransactionalSink) -> None:
        self.sink = sink
        self.outputs: list[Output] = []

    async def apply(self, delivery: Delivery, replaying: bool) -> None:
        commands = self.sink.router.commands_topic
        sends = await reactor_commands(self.sink.subscription.name, delivery, replaying, self.sink.router.registry)
        # The worker's span for this delivery is current: the processor's handling of these
        # commands joins its trace.
        headers = tracing.headers_for() if self.sink.traced and sends else None
        for command_id, send in sends:
            envelope = command_envelope(command_id, send, delivery)
            self.outputs.append(Output(commands, envelope.key, envelope.encode(), headers=headers))

    async def park(self, event: ParkedEvent) -> None:
        self.outputs.append(parked_output(self.sink.parked_topic, event))

    async def parked_of(self, aggregate_id: str) -> list[ParkedEvent]:
        return await parked_in_topic(self.sink.parked_topic, self.sink.tp, aggregate_id)

    async def entry_at(self, offset: int) -> ParkedEvent | None:
        return await entry_in_topic(self.sink.parked_topic, self.sink.tp, offset)

    async def commit(self, next_offset: int | None) -> None:
        outputs, self.outputs = self.outputs, []
        offsets = {self.sink.tp: next_offset} if next_offset is not None else None
        try:
            await self.sink.producer.commit(outputs, offsets, self.sink.group_id)
        except ProducerFenced as error:
            raise Fenced(f"{self.sink.producer.transactional_id} was fenced: {error}") from error

    async def abort(self) -> None:
        self.outputs = []  # nothing reached Kafka: a transaction is only open inside commit


class OffsetCommitSink(PartitionSink):
    """A SideEffectHandler's input partition: the handler first, the offset after it."""

    # Neither a lock nor a fence: a retry from the command line runs beside the member.
    resolves_alone = False

    def __init__(
        self,
        subscription: AnySubscription,
        consumer: AIOKafkaConsumer,
        producer: AIOKafkaProducer,
        parked_topic: ParkedTopic,
        tp: TopicPartition,
    ) -> None:
        self.subscription = subscription
        self.consumer = consumer
        self.producer = producer
        self.parked_topic = parked_topic
        self.tp = tp

    async def open(self) -> StartingPoint:
        return await starting_point(self.consumer, self.parked_topic, self.tp)

    async def begin(self) -> Unit:
        return OffsetCommitUnit(self)

    async def close(self) -> None:
        """The producer is the runner's, shared by its partitions."""


class OffsetCommitUnit(Unit):
    def __init__(self, sink: OffsetCommitSink) -> None:
        self.sink = sink

    async def apply(self, delivery: Delivery, replaying: bool) -> None:
        await call_handler(delivery, self.sink.subscription.name, replaying)

    async def park(self, event: ParkedEvent) -> None:
        # Written before the offset moves past it; written twice after a crash, it is the
        # same key, which compaction keeps once.
        out = parked_output(self.sink.parked_topic, event)
        await self.sink.producer.send_and_wait(out.topic, out.value, key=out.key, partition=out.partition)

    async def parked_of(self, aggregate_id: str) -> list[ParkedEvent]:
        return await parked_in_topic(self.sink.parked_topic, self.sink.tp, aggregate_id)

    async def entry_at(self, offset: int) -> ParkedEvent | None:
        return await entry_in_topic(self.sink.parked_topic, self.sink.tp, offset)

    async def commit(self, next_offset: int | None) -> None:
        if next_offset is None:
            return
        try:
            await self.sink.consumer.commit({self.sink.tp: next_offset})
        except (CommitFailedError, IllegalStateError) as error:
            raise Fenced(f"{self.sink.subscription.name}: {self.sink.tp.topic}/{self.sink.tp.partition} is no longer this member's: {error}") from error

    async def abort(self) -> None:
        """Nothing to undo: what a side effect did is done."""
