"""Prometheus metrics of every esk process (served on /metrics)."""

import contextlib
from collections.abc import Iterable, Iterator
from enum import StrEnum

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

COMMANDS = Counter("esk_commands_total", "Commands handled by the processor, by outcome", ["type", "outcome"])
DLQ_RECORDS = Counter("esk_dlq_records_total", "Records sent to the DLQ", ["topic"])
COMMIT_SECONDS = Histogram(
    "esk_commit_seconds",
    "Time to commit one batch (transaction + RocksDB write)",
    buckets=(0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5),
)
TRANSACTION_RECORDS = Histogram(
    "esk_transaction_records", "Records produced per transaction", buckets=(1, 4, 16, 64, 256, 1024, 4096, 16384)
)
RESTORE_RECORDS = Counter("esk_restore_records_total", "Changelog records restored", ["role"])
RESTORE_REMAINING = Gauge("esk_restore_remaining_records", "Changelog records left to restore", ["role", "partition"])
REBUILD_EVENTS = Counter("esk_rebuild_events_total", "Events read to rebuild aggregate states after a state model changed")
REBUILT_AGGREGATES = Counter("esk_rebuilt_aggregates_total", "Aggregate states rebuilt from their events after a state model changed")
UNUSABLE_AGGREGATES = Gauge(
    "esk_unusable_aggregates", "Aggregates whose events could not be folded into the current state model", ["partition"]
)
RESTORE_RATE = Gauge("esk_restore_records_per_second", "Rate of the latest restore", ["role", "partition"])
ACTIVE_TASKS = Gauge("esk_active_tasks", "Partitions this processor owns")
COMMANDS_LAG = Gauge(
    "esk_commands_lag", "Commands of a partition this processor runs that it has not handled yet (up to the last stable offset)",
    ["partition"],
)
STANDBY_TASKS = Gauge("esk_standby_tasks", "Partitions this processor keeps a warm standby copy of")
REVOKE_SECONDS = Histogram(
    "esk_revoke_seconds",
    "Time to give up revoked partitions (final commit, stores and producers closed)",
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30),
)
STORE_MEMORY = Gauge("esk_rocksdb_cache_bytes", "RocksDB shared cache usage (blocks + memtables)", ["role"])
HTTP_REQUESTS = Counter(
    "esk_http_requests_total", "Requests the API answered, by method, route template and status", ["method", "route", "status"]
)
# From a millisecond's read to a command's outcome awaited, or a read that waits up to
# `read_wait_max_s`: the buckets reach past the outcome's default timeout.
HTTP_REQUEST_SECONDS = Histogram(
    "esk_http_request_seconds",
    "Time from a request's arrival to the end of its answer, by method and route template",
    ["method", "route"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
)
HTTP_OUTCOME_TIMEOUTS = Counter("esk_http_outcome_timeouts_total", "Commands answered 503: no outcome in time")
API_KAFKA_AWAY = Gauge(
    "esk_api_kafka_away", "1 while the API's last command found no broker to store it: others are answered 503 at once"
)
EXPIRED = Counter("esk_expired_entries_total", "Store entries deleted by TTL (aggregates and de-duplication entries)")
SUBSCRIPTION_EVENTS = Counter(
    "esk_subscription_events_total",
    "Events a subscription handled, parked, or saw fail an attempt",
    ["subscription", "result"],
)
SUBSCRIPTION_LAG = Gauge(
    "esk_subscription_lag", "Records of an input partition not yet handled by the subscription", ["subscription", "topic", "partition"]
)
SUBSCRIPTION_CAUGHT_UP = Gauge(
    "esk_subscription_caught_up", "1 when every input partition this subscriber owns is handled up to its end", ["subscription"]
)
SUBSCRIPTION_PARKED = Gauge(
    "esk_subscription_parked",
    "Events of an input partition parked now (read from the store), by why (the result they counted under)",
    ["subscription", "topic", "partition", "result"],
)
SUBSCRIPTION_PARTITIONS = Gauge("esk_subscription_partitions", "Input partitions this subscriber owns and has started", ["subscription"])


def forget_partitions(numbers: Iterable[int]) -> None:
    """Drop the per-partition samples of commands partitions this processor no longer has:
    their new owner reports them, and a value left behind (a lag, a restore cut short by
    the revocation) would stay on the dashboard and keep an alert firing."""
    for number in numbers:
        partition = str(number)
        for gauge, labels in (
            (COMMANDS_LAG, (partition,)),
            (UNUSABLE_AGGREGATES, (partition,)),
            *((gauge, (role, partition)) for gauge in (RESTORE_REMAINING, RESTORE_RATE) for role in ("processor", "rebuilding")),
        ):
            with contextlib.suppress(KeyError):  # never reported
                gauge.remove(*labels)
READ_MODEL_POSITION = Gauge(
    "esk_read_model_position", "The offset up to which a read model's current table reflects an events partition (read-your-writes)",
    ["read_model", "topic", "partition"],
)
READ_MODEL_LAG = Gauge(
    "esk_read_model_lag",
    "Events of an events partition that a read model's current table does not reflect yet: this API instance's history "
    "index's position there minus the read model's (reported once the index has caught up; none without it)",
    ["read_model", "topic", "partition"],
)
READ_MODEL_PARKED = Gauge(
    "esk_read_model_parked",
    "Aggregates a read model's current table holds back: an event of each failed the read model's batch "
    "(`esk project parked`; a rebuild after a fix takes them in again)",
    ["read_model"],
)
HISTORY_POSITION = Gauge(
    "esk_history_position",
    "The offset up to which this API instance's history index reflects an events partition (GET /v1/{type}/{id}/events)",
    ["topic", "partition"],
)


class Kind(StrEnum):
    """The kinds of esk process, each with a /metrics of its own."""

    PROCESSOR = "processor"
    API = "api"
    SUBSCRIBER = "subscriber"


_OWN: dict[Kind, tuple[MetricWrapperBase, ...]] = {
    Kind.PROCESSOR: (
        COMMANDS, DLQ_RECORDS, COMMIT_SECONDS, TRANSACTION_RECORDS, RESTORE_RECORDS, RESTORE_REMAINING, REBUILD_EVENTS,
        REBUILT_AGGREGATES, UNUSABLE_AGGREGATES, RESTORE_RATE, ACTIVE_TASKS, COMMANDS_LAG, STANDBY_TASKS, REVOKE_SECONDS,
        STORE_MEMORY, EXPIRED,
    ),
    Kind.API: (
        STORE_MEMORY, HTTP_REQUESTS, HTTP_REQUEST_SECONDS, HTTP_OUTCOME_TIMEOUTS, API_KAFKA_AWAY, READ_MODEL_POSITION, READ_MODEL_LAG,
        READ_MODEL_PARKED, HISTORY_POSITION,
    ),
    Kind.SUBSCRIBER: (SUBSCRIPTION_EVENTS, SUBSCRIPTION_LAG, SUBSCRIPTION_CAUGHT_UP, SUBSCRIPTION_PARKED, SUBSCRIPTION_PARTITIONS),
}


class _KindsOwn(Collector):
    """The default registry's metrics, but for the esk metrics of the other kinds of
    process: this module defines all of them in every process, and an unlabelled one
    would be exported at 0 (`esk_active_tasks` by an API, say), which a dashboard or an
    alert counting series would take for a processor."""

    def __init__(self, kind: Kind) -> None:
        self.names = frozenset(family.name for metric in _OWN[kind] for family in metric.describe())

    def collect(self) -> Iterator[Metric]:
        for family in REGISTRY.collect():
            if family.name in self.names or not family.name.startswith("esk_"):
                yield family


def exported(kind: Kind) -> CollectorRegistry:
    """What /metrics serves in a process of `kind`: its own esk metrics, and the process's
    (process_*, python_*)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_KindsOwn(kind))
    return registry
