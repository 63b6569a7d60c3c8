"""What an application's Kafka principal must be allowed, on a cluster whose authorizer
refuses what no ACL allows, and how a refusal is told.

Every topic, consumer group and transactional id of an application starts with `<app>.`
(esk.kafka.topics.TopicNames, the processor's and the subscriptions' groups, their
transactional ids), but for a processor group named otherwise (ESK_PROCESSOR__GROUP_ID):
prefixed ACLs cover them. Spark's Kafka source reads by assignment and commits nothing, and
esk's other readers have no group: no other name needs one. `esk topics acls` prints them
as `kafka-acls` commands.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import Literal, TypeAlias

from aiokafka.errors import (
    ClusterAuthorizationFailedError,
    GroupAuthorizationFailedError,
    TopicAuthorizationFailedError,
    TransactionalIdAuthorizationFailed,
)

from ..settings import Settings
from .topics import processor_group

ResourceType = Literal["topic", "group", "transactional-id"]

AuthorizationRefused: TypeAlias = (
    TopicAuthorizationFailedError | GroupAuthorizationFailedError | ClusterAuthorizationFailedError | TransactionalIdAuthorizationFailed
)
AUTHORIZATION_REFUSED = (
    TopicAuthorizationFailedError,
    GroupAuthorizationFailedError,
    ClusterAuthorizationFailedError,
    TransactionalIdAuthorizationFailed,
)  # for `except`, which takes no union


@dataclass(frozen=True)
class PrefixedAcl:
    """Allow `operations` on every resource of `resource_type` whose name starts with `prefix`."""

    resource_type: ResourceType
    prefix: str
    operations: tuple[str, ...]  # as kafka-acls names them
    why: str

    def kafka_acls_command(self, bootstrap_servers: str, principal: str) -> str:
        """The `kafka-acls` command line that grants it to `principal`."""
        operations = [argument for operation in self.operations for argument in ("--operation", operation)]
        return shlex.join(
            [
                "kafka-acls.sh",
                "--bootstrap-server",
                bootstrap_servers,
                "--add",
                "--allow-principal",
                principal,
                *operations,
                f"--{self.resource_type}",
                self.prefix,
                "--resource-pattern-type",
                "prefixed",
            ]
        )


def application_acls(settings: Settings) -> list[PrefixedAcl]:
    """The ACLs one principal needs to run every esk process of `settings.app`: `esk topics
    init`, the processor, the API, the subscribers and the read models."""
    prefix = f"{settings.app}."
    group = processor_group(settings)
    named_otherwise = [
        PrefixedAcl("group", group, ("Describe", "Read"), "the processor's group, named by ESK_PROCESSOR__GROUP_ID"),
        PrefixedAcl("transactional-id", f"{group}.", ("Describe", "Write"), "the processor's tasks, named after its group"),
    ]
    return [
        PrefixedAcl(
            "topic",
            prefix,
            ("Create", "Describe", "DescribeConfigs", "Read", "Write"),
            "`esk topics init` makes and checks the topics; the processes read and write them",
        ),
        PrefixedAcl(
            "group",
            prefix,
            ("Describe", "Read"),
            "the processor's and each subscription's consumer group, and their committed offsets",
        ),
        PrefixedAcl(
            "transactional-id",
            prefix,
            ("Describe", "Write"),
            "the processor's tasks and each reactor's partitions write in transactions",
        ),
        *(named_otherwise if not group.startswith(prefix) else ()),
    ]


def kafka_acls_script(settings: Settings, principal: str) -> list[str]:
    """`kafka-acls` command lines that grant `principal` what `settings.app` needs, each
    after a comment that says what it is for, to be run by a principal allowed to change
    ACLs (with its own `--command-config`)."""
    return [
        line
        for acl in application_acls(settings)
        for line in (f"# {acl.why}", acl.kafka_acls_command(settings.bootstrap_servers, principal))
    ]


def refused_by_authorizer(settings: Settings, error: AuthorizationRefused) -> str:
    """One line for an error the cluster's authorizer gave: who was refused, what the
    broker said, and where to find the ACLs esk needs."""
    user = settings.kafka.sasl_plain_username
    who, principal = (f"user {user!r}", f"User:{user}") if user else ("esk's clients", "User:<name>")
    told = error.args[0] if error.args and isinstance(error.args[0], str) else ""
    detail = f" ({told})" if told and told != error.message else ""
    return (
        f"Kafka at {settings.bootstrap_servers} refused {who}: {error.message}{detail}; "
        f"`esk topics acls --principal {principal}` prints the ACLs app {settings.app!r} needs"
    )
