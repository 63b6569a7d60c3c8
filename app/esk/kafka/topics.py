"""The topics of an esk application, and `esk topics init`: create them or check them.

Running it twice changes nothing. A topic that exists with the wrong partition count,
cleanup policy, or replication is reported as a problem, never silently accepted:
the changelog must be co-partitioned with the commands topic or restores go wrong.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.errors import (
    ClusterAuthorizationFailedError,
    KafkaError,
    TopicAlreadyExistsError,
    TopicAuthorizationFailedError,
    for_code,
)

from ..settings import Settings
from .admin import retry_while_brokers_fail
from .client_options import client_options


@dataclass(frozen=True)
class TopicSpec:
    name: str
    partitions: int
    replication_factor: int
    configs: dict[str, str]


@dataclass(frozen=True)
class TopicNames:
    """Topic names of one application (`<app>.*`)."""

    app: str

    @property
    def commands(self) -> str:
        return f"{self.app}.commands"

    @property
    def results(self) -> str:
        return f"{self.app}.results"

    @property
    def changelog(self) -> str:
        return f"{self.app}.changelog"

    @property
    def dlq(self) -> str:
        return f"{self.app}.dlq"

    @property
    def schemas(self) -> str:
        return f"{self.app}.schemas"

    def events(self, aggregate_type: str) -> str:
        return f"{self.app}.{aggregate_type}.events"


def processor_group(settings: Settings) -> str:
    """The processor's consumer group; its tasks' transactional ids are `<group>.<partition>`."""
    return settings.processor.group_id or f"{settings.app}.processor"


def topic_specs(settings: Settings, aggregate_types: Iterable[str]) -> list[TopicSpec]:
    names = TopicNames(settings.app)
    t = settings.topics
    common = {"min.insync.replicas": str(t.min_insync_replicas)}

    def spec(name: str, **configs: str) -> TopicSpec:
        return TopicSpec(name, t.partitions, t.replication_factor, {**common, **configs})

    return [
        spec(names.commands, **{"cleanup.policy": "delete"}),
        spec(names.results, **{"cleanup.policy": "delete", "retention.ms": str(t.results_retention_ms)}),
        spec(names.changelog, **{"cleanup.policy": "compact"}),
        spec(names.dlq, **{"cleanup.policy": "delete", "retention.ms": str(t.dlq_retention_ms)}),
        # What each event schema version stored is (esk.schema.recorded): a few records.
        TopicSpec(names.schemas, 1, t.replication_factor, {**common, "cleanup.policy": "compact"}),
        # Events are the source of truth: kept forever.
        *(spec(names.events(a), **KEPT_FOREVER) for a in aggregate_types),
    ]


KEPT_FOREVER = {"cleanup.policy": "delete", "retention.ms": "-1", "retention.bytes": "-1"}


@dataclass
class TopicReport:
    created: list[str] = field(default_factory=list)
    ok: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


# Checked on existing topics. Retention is left to operators once a topic exists, but for
# the events topics: a topic made before `esk topics init` (by hand, by the broker's own
# defaults) that deletes events after a time or a size would lose the source of truth.
_CHECKED_CONFIGS = ("cleanup.policy", "min.insync.replicas")
_CHECKED_WHEN_KEPT_FOREVER = ("retention.ms", "retention.bytes")


async def ensure_topics(settings: Settings, specs: list[TopicSpec]) -> TopicReport:
    report = TopicReport()
    admin = AIOKafkaAdminClient(**client_options(settings))
    await admin.start()
    try:
        existing = set(await retry_while_brokers_fail(admin.list_topics))
        missing = [s for s in specs if s.name not in existing]
        for s in missing:
            new_topic = NewTopic(s.name, s.partitions, s.replication_factor, topic_configs=s.configs)
            # asked again after a failure, a topic that was created is "already exists" below
            response = await retry_while_brokers_fail(functools.partial(admin.create_topics, [new_topic]))
            for _name, code, *message in response.topic_errors:
                if code == 0:
                    report.created.append(s.name)
                elif code == TopicAlreadyExistsError.errno:  # created meanwhile by another instance
                    existing.add(s.name)
                elif code in _REFUSED:  # the wait below would only time out
                    raise for_code(code)(f"creating {s.name}")
                else:
                    report.problems.append(f"{s.name} could not be created: error {code} {message}")
        # checked as the wait saw them: a second look may reach a broker whose metadata has
        # lost the topic for a moment (a peer just died), which is no answer about the topic
        described = await _wait_until_visible(admin, [s.name for s in specs])
        await _check(admin, [s for s in specs if s.name in existing], described, report)
    finally:
        await admin.close()
    return report


async def missing_topics(settings: Settings, names: Iterable[str]) -> list[str]:
    """Those of `names` the cluster does not have. A topic the principal may not describe
    raises TopicAuthorizationFailedError: listed, it would look missing, and a process
    would wait for `esk topics init` for ever."""
    admin = AIOKafkaAdminClient(**client_options(settings))
    await admin.start()
    try:
        existing = set(await retry_while_brokers_fail(admin.list_topics))
        missing = [name for name in names if name not in existing]
        if missing:
            for described in await retry_while_brokers_fail(functools.partial(admin.describe_topics, missing)):
                if described["error_code"] in _REFUSED:
                    raise for_code(described["error_code"])(f"describing {described['topic']}")
    finally:
        await admin.close()
    return missing


_REFUSED = (TopicAuthorizationFailedError.errno, ClusterAuthorizationFailedError.errno)


async def coordinators_ready(settings: Settings, timeout_s: float = 30.0) -> Exception | None:
    """A new cluster makes the topics of its group and transaction coordinators on the first
    request for one, and answers "not available" until they are led: waited out once, as
    the topics are made, rather than by each processor and subscriber, which log every such
    answer. Returns why they did not answer (a principal not allowed to ask, say), if not."""
    group = processor_group(settings)
    # a consumer group's, a transactional id's: the processor's, and its first task's
    # (`<group>.<partition>`, which the ACLs of `esk topics acls` cover)
    keys = ((group, 0), (f"{group}.0", 1))
    admin = AIOKafkaAdminClient(**client_options(settings))
    await admin.start()
    try:
        for key, coordinator_type in keys:
            await retry_while_brokers_fail(functools.partial(admin.find_coordinator, key, coordinator_type), timeout_s, expected=True)
    except (KafkaError, TimeoutError) as error:
        return error
    finally:
        await admin.close()
    return None


async def _wait_until_visible(admin: AIOKafkaAdminClient, names: list[str], timeout_s: float = 30.0) -> dict[str, Any]:
    """The topics `names` as described by the first broker to know them all, by name:
    topic creation returns before every broker's metadata shows the new partitions."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        described = await retry_while_brokers_fail(functools.partial(admin.describe_topics, names))
        if all(d["error_code"] == 0 and d["partitions"] for d in described):
            return {d["topic"]: d for d in described}
        if refused := [d for d in described if d["error_code"] in _REFUSED]:
            raise for_code(refused[0]["error_code"])(f"describing {refused[0]['topic']}")
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError(f"topics not visible in metadata after {timeout_s:.0f}s: {names}")
        await asyncio.sleep(0.1)


async def topic_configs(admin: AIOKafkaAdminClient, names: list[str]) -> dict[str, dict[str, str]]:
    """The configs of the topics `names`, by name. The broker asked answers for each topic on
    its own, and may not know one yet (its metadata behind the controller's, for a moment
    after a topic is made or a peer dies): that answer is raised, to be asked again or
    shown, never read as a topic without configs."""
    resources = [ConfigResource(ConfigResourceType.TOPIC, name) for name in names]
    configs: dict[str, dict[str, str]] = {}
    for response in await admin.describe_configs(resources):
        for error_code, message, _type, name, entries, *_ in response.resources:
            if error_code:
                raise for_code(error_code)(f"the configs of {name}: {message}")
            configs[name] = {entry[0]: entry[1] for entry in entries}
    return configs


async def _check(admin: AIOKafkaAdminClient, specs: list[TopicSpec], by_name: dict[str, Any], report: TopicReport) -> None:
    actual_configs = await retry_while_brokers_fail(functools.partial(topic_configs, admin, [s.name for s in specs]))
    for s in specs:
        problems: list[str] = []
        partitions = by_name[s.name]["partitions"]
        if len(partitions) != s.partitions:
            problems.append(f"has {len(partitions)} partitions, expected {s.partitions}")
        replicas = {len(p["replicas"]) for p in partitions}
        if replicas and replicas != {s.replication_factor}:
            # One figure, as Kafka sets it per topic; several only when partitions were reassigned apart.
            factor = " or ".join(map(str, sorted(replicas)))
            problems.append(f"has replication factor {factor}, expected {s.replication_factor}")
        kept_forever = all(s.configs.get(key) == value for key, value in KEPT_FOREVER.items())
        for key in (*_CHECKED_CONFIGS, *(_CHECKED_WHEN_KEPT_FOREVER if kept_forever else ())):
            want, have = s.configs.get(key), actual_configs.get(s.name, {}).get(key)
            if want is not None and have != want:
                why = (
                    f" (events are kept forever, and Kafka deletes them past any other: `kafka-configs.sh --alter --entity-type "
                    f"topics --entity-name {s.name} --add-config {key}={want}`)"
                    if key in _CHECKED_WHEN_KEPT_FOREVER else ""
                )
                problems.append(f"has {key}={have}, expected {want}{why}")
        if problems:
            report.problems.append(f"{s.name} " + "; ".join(problems))
        else:
            report.ok.append(s.name)
