"""Where one subscription keeps its effects, offsets and parked events, by kind, and the sink
of each input partition onto them: what `esk subscriber` runs on, and what the
`esk subscriptions` commands act on (the same sinks, so a retry from the command line is
fenced and committed as the subscriber's own work is)."""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from ..domain.aggregate import one_line
from ..kafka.client_options import client_options
from ..kafka.topics import ensure_topics
from ..settings import Settings
from .api import AnySubscription, DatabaseHandler, Kind
from .database import Database, SQLite
from .database_sink import DatabaseSink, prepare
from .kafka_sinks import OffsetCommitSink, TransactionalSink
from .parked_topic import ParkedTopic, parked_topic_spec
from .parking import PARKED_RESULTS, ParkStatus, parked_result
from .routing import Router
from .sinks import PartitionSink


def group_id(settings: Settings, subscription: AnySubscription) -> str:
    return f"{settings.app}.subscription.{subscription.name}"


def database_of(settings: Settings, subscription: DatabaseHandler) -> Database:
    config = subscription.database or SQLite()
    return config.connect(_in_data_dir(settings, subscription))


def _in_data_dir(settings: Settings, subscription: DatabaseHandler) -> Path:
    """Where a subscription's SQLite database is when it names no other."""
    return Path(settings.subscriber.data_dir) / f"{subscription.name}.sqlite"


class DatabaseUnreachable(Exception):
    """A database handler's database did not answer as the stores opened."""

    def __init__(self, database: Database, cause: Exception) -> None:
        self.where, self.cause = database.describe(), cause
        super().__init__(f"its database {self.where} does not answer ({one_line(cause)})")


class DatabaseMissing(Exception):
    """A command-line tool found no database where the subscriber would have written one."""

    def __init__(self, database: Database, subscription: DatabaseHandler, settings: Settings) -> None:
        in_data_dir = database.describe() == str(_in_data_dir(settings, subscription))
        setting = f"ESK_SUBSCRIBER__DATA_DIR={settings.subscriber.data_dir}" if in_data_dir else "these settings"
        super().__init__(
            f"no database at {database.describe()}: its subscriber has not run with {setting} (run this where it runs, with its settings)"
        )


class Stores:
    """Open it (inside the running loop) with the consumer whose group holds the Kafka kinds'
    offsets: the subscriber's own member, or for a command-line tool one that is in no group
    (it reads and commits offsets without joining)."""

    def __init__(self, settings: Settings, subscription: AnySubscription, router: Router) -> None:
        self.settings = settings
        self.subscription = subscription
        self.router = router
        self.group_id = group_id(settings, subscription)
        self.database: Database | None = None
        self.parked_topic: ParkedTopic | None = None
        self._producer: AIOKafkaProducer | None = None
        self._consumer: AIOKafkaConsumer | None = None

    async def open(self, consumer: AIOKafkaConsumer, *, make_database: bool = True) -> None:
        """`make_database`: False for a tool that reads what the subscriber wrote, which a
        database made empty would only hide (a wrong data directory read as nothing done)."""
        self._consumer = consumer
        subscription = self.subscription
        if isinstance(subscription, DatabaseHandler):
            database = database_of(self.settings, subscription)
            if not make_database and database.missing():
                raise DatabaseMissing(database, subscription, self.settings)
            try:
                await prepare(database, subscription)
            except Exception as error:
                await database.close()
                if database.unreachable(error):
                    raise DatabaseUnreachable(database, error) from error
                raise
            self.database = database
            return
        report = await ensure_topics(self.settings, [parked_topic_spec(self.settings, subscription.name)])
        if report.problems:
            raise RuntimeError("; ".join(report.problems))
        self.parked_topic = ParkedTopic(self.settings, subscription.name)
        if subscription.kind is Kind.SIDE_EFFECT:
            self._producer = AIOKafkaProducer(**client_options(self.settings), acks="all", enable_idempotence=True)
            await self._producer.start()

    def sink(self, tp: TopicPartition) -> PartitionSink:
        subscription = self.subscription
        if isinstance(subscription, DatabaseHandler):
            assert self.database is not None, "open the stores first"
            return DatabaseSink(self.database, subscription, tp)
        assert self.parked_topic is not None and self._consumer is not None, "open the stores first"
        if subscription.kind is Kind.REACTOR:
            return TransactionalSink(self.settings, subscription, self.router, self._consumer, self.parked_topic, self.group_id, tp)
        assert self._producer is not None
        return OffsetCommitSink(subscription, self._consumer, self._producer, self.parked_topic, tp)

    async def parked_counts(self, tps: Collection[TopicPartition]) -> dict[TopicPartition, dict[str, int]]:
        """How many events of each input partition in `tps` are parked now, as the store has
        them (a retry from the command line included), by why (PARKED_RESULTS)."""
        counts = {tp: dict.fromkeys(PARKED_RESULTS, 0) for tp in tps}
        if self.database is not None:
            async with self.database.transaction() as tx:
                rows = await tx.esk.fetchall(
                    "SELECT topic, kafka_partition, reason, COUNT(*) FROM esk_parked WHERE subscription = ? AND status = ? "
                    "GROUP BY topic, kafka_partition, reason",
                    (self.subscription.name, ParkStatus.PARKED.value),
                )
            for topic, partition, reason, n in rows:
                if (tp := TopicPartition(str(topic), int(partition))) in counts:
                    counts[tp][parked_result(str(reason))] += int(n)
            return counts
        topic = self.parked_topic
        assert topic is not None, "open the stores first"
        states = {p: await topic.refresh(p) for p in sorted({topic.partition_of(tp.partition) for tp in tps})}
        for tp in tps:
            for event in states[topic.partition_of(tp.partition)].still_parked(tp.topic, tp.partition):
                counts[tp][parked_result(event.reason)] += 1
        return counts

    async def close(self) -> None:
        if self._producer is not None:
            await self._producer.stop()
            self._producer = None
        if self.parked_topic is not None:
            await self.parked_topic.close()
            self.parked_topic = None
        if self.database is not None:
            await self.database.close()
            self.database = None
