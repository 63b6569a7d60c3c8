"""One typed settings object for every esk process.

Values come from ESK_* environment variables and a `.env` file; CLI flags override both.
Kafka client security options are passed through untouched (see `kafka.client_options`).
"""

from __future__ import annotations

import difflib
import json
import os
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from dotenv import dotenv_values
from pydantic import BaseModel, Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict, SettingsError

# Everything esk keeps on disk lives under the directory it runs in, never under the
# installed package: an esk installed from a wheel works from any project directory.
DATA_ROOT = Path(".esk")


class KafkaSettings(BaseModel):
    """How every esk client reaches Kafka.

    `bootstrap_servers=None` means: use the embedded broker on `broker.host:broker.port`.
    """

    bootstrap_servers: str | None = None
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    ssl_cafile: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    ssl_password: str | None = None
    ssl_check_hostname: bool = True
    sasl_mechanism: str | None = None
    sasl_plain_username: str | None = None
    sasl_plain_password: str | None = None
    sasl_kerberos_service_name: str | None = None
    sasl_kerberos_domain_name: str | None = None
    request_timeout_ms: int = 30_000
    # Anything else an aiokafka client accepts, e.g. {"connections_max_idle_ms": 540000}.
    extra: dict[str, Any] = Field(default_factory=dict)


class BrokerSaslSslSettings(BaseModel):
    """A TLS + SASL/SCRAM client listener for the embedded broker, to try a secured setup on
    one machine: its clients then need ESK_KAFKA__SECURITY_PROTOCOL=SASL_SSL and the rest.
    Broker-to-broker traffic stays PLAINTEXT, on a port of loopback only."""

    keystore: Path  # the broker's private key (PKCS#8) and certificate, or a PKCS12 or JKS keystore
    keystore_type: Literal["PEM", "PKCS12", "JKS"] = "PEM"
    keystore_password: str | None = None
    scram_mechanism: Literal["SCRAM-SHA-256", "SCRAM-SHA-512"] = "SCRAM-SHA-512"
    # name -> password, e.g. {"esk": "..."}; created when the storage is formatted (first start).
    users: dict[str, str] = Field(default_factory=dict)
    internal_port: int | None = None  # default: port + 2
    # Clients must also present a TLS certificate issued by one of these CAs (PEM); their
    # principal stays their SASL user. None: no client certificate asked for.
    client_ca: Path | None = None
    # Kafka's StandardAuthorizer on: a user may then do only what ACLs allow it
    # (`esk topics acls` prints esk's), but for these users, who may do anything.
    acls: bool = False
    super_users: list[str] = Field(default_factory=list)


class BrokerSettings(BaseModel):
    """The embedded single-node KRaft broker run by `esk broker`."""

    host: str = "127.0.0.1"
    port: int = 9092
    controller_port: int | None = None  # default: port + 1
    data_dir: Path = DATA_ROOT / "broker"
    jars_dir: Path | None = None  # default: resolved from Maven Central into the jar cache
    java: str = "java"
    heap: str = "512m"
    start_timeout_s: float = 90.0
    sasl_ssl: BrokerSaslSslSettings | None = None  # None: a PLAINTEXT listener


class TopicSettings(BaseModel):
    partitions: int = 6
    replication_factor: int = 1
    min_insync_replicas: int = 1
    # Results and DLQ records are only needed for a while; events and the changelog are kept.
    results_retention_ms: int = 7 * 24 * 3600 * 1000
    dlq_retention_ms: int = 30 * 24 * 3600 * 1000


class ProcessorSettings(BaseModel):
    state_dir: Path = DATA_ROOT / "state" / "processor"
    group_id: str | None = None  # default: "<app>.processor"
    batch_max_records: int = 1000
    commit_interval_ms: int = 100
    # The least time from the start of one transaction of a task to the start of its next.
    # A task that was idle commits at once; under load its commands gather into fewer,
    # larger transactions, and most of what a transaction costs the broker is per transaction.
    commit_spacing_ms: int = 25
    # Every transaction records its task's input position in the changelog; the consumer
    # group's committed offsets (what lag monitoring reads) follow at most this far behind.
    group_offset_interval_ms: int = 1000
    dedup_window_s: int = 7 * 24 * 3600
    # How often each task deletes what expired (aggregate retention, de-duplication window).
    expiry_interval_s: float = 10.0
    expiry_batch: int = 1000
    memory_budget_mb: int = 256
    # Warm copies of each partition kept by other processors (following the changelog),
    # so that a failover replays only the tail. Needs at least 1 + N processors to matter.
    standby_replicas: int = 0
    # How long the store of a partition this processor neither owns nor keeps a standby copy
    # of stays on disk (warm, should the partition come back) before it is deleted.
    state_cleanup_delay_s: float = 600.0
    transaction_timeout_ms: int = 60_000
    session_timeout_ms: int = 10_000
    max_poll_interval_ms: int = 300_000
    # How long partitions given up (a rebalance, a stop) wait for their commits in flight
    # and final commits: a commit waits on its broker for as long as the broker is away, and
    # every member of the group waits for the slowest revoke. Past it they close without;
    # the next owner handles those commands again (nothing lost, nothing doubled).
    close_timeout_ms: int = 10_000
    # Prometheus metrics, /healthz and /readyz of `esk processor` (None, in code alone: no
    # such server; a test's processes share one).
    metrics_port: int | None = 9464
    metrics_host: str = "127.0.0.1"


class ApiSettings(BaseModel):
    host: str = "127.0.0.1"
    port: int = 8000
    state_dir: Path = DATA_ROOT / "state" / "api"
    # How long a command waits for the broker to acknowledge it before its 503: aiokafka's
    # idempotent producer retries a send for as long as its broker is away, which would
    # hold the request for the whole outage.
    submit_timeout_s: float = Field(default=10.0, gt=0.0)
    outcome_timeout_s: float = 10.0
    min_version_timeout_s: float = 5.0
    # An accepted command's answer carries its events' position (read-your-writes); given up
    # after this long (a broker away), the answer goes out without one; 0: never looked up.
    position_timeout_s: float = 1.0
    # How long a read of a read model may wait for the positions it is given (`after`).
    read_wait_max_s: float = 30.0
    max_body_bytes: int = 64 * 1024
    # How long an idle keep-alive connection stays open. Longer than the idle timeout of
    # the proxies and load balancers in front (60 s for most): one that closes first can
    # race a request the proxy sends on it, which then fails (a reset, a 502). uvicorn's
    # own default is 5 s.
    keep_alive_s: int = Field(default=75, ge=1)
    retry_after_s: int = 1
    # Bearer tokens allowed to call the API; empty = auth off.
    auth_tokens: list[str] = Field(default_factory=list)
    # The history index (GET /v1/{type}/{id}/events): every event of every aggregate type,
    # kept by each API instance from the events topics; false on instances that serve no
    # history (they read no events, and the route answers 404 history_disabled).
    history: bool = True
    # The history index's RocksDB block cache and write buffers (the replica has 128 MB).
    history_memory_budget_mb: int = 64
    # Events a history read returns at most (its `limit`, and the default): a long-lived
    # aggregate's history is read a page at a time (`from_version`, the answer's `next_version`).
    history_page_max: int = Field(default=1000, ge=1)


class ProjectionSettings(BaseModel):
    """PySpark projections: local mode by default; a cluster through spark-submit."""

    warehouse_dir: Path = DATA_ROOT / "warehouse"
    jars_dir: Path | None = None  # default: resolved from Maven Central into the jar cache
    spark_master: str = "local[2]"
    driver_memory: str = "1g"
    # The driver JVM's options in local mode (under spark-submit, the cluster's
    # configuration has them). The throughput collector: it catches up faster than Java's
    # default (G1), and its pauses kept within the lag's bound over 30 minutes of
    # `--continuous` (docs/benchmarks.md, W4).
    driver_java_options: str = "-XX:+UseParallelGC"
    shuffle_partitions: int = 4
    # How often `--continuous` looks for new events: a small batch takes about a second
    # (docs/benchmarks.md), and a look that finds none costs one offsets request.
    trigger_interval_s: float = 0.5
    max_offsets_per_trigger: int | None = None
    # How long Spark's Kafka clients wait for one call (a request, and the driver's offset
    # lookup as a whole), shorter than esk's own clients' (ESK_KAFKA__REQUEST_TIMEOUT_MS):
    # the driver's Admin client holds an offset lookup on a broker that died until the
    # call times out, and the read model stands still that long (docs/benchmarks.md). A
    # lookup is tried again, for as long in all as three of esk's clients' request timeouts.
    kafka_call_timeout_ms: int = Field(default=5_000, ge=1_000)
    # Batches of up to this many events are written by delta-rs on the driver, bigger ones
    # by Spark on the executors (projections.catalog.BatchWriter); 0: always Spark.
    driver_write_max_events: int = 20_000
    # Rows the HTTP API returns at most per projection query.
    api_row_limit: int = 1000
    # `esk dev` keeps every read model up (`esk project run --all --continuous`, a Spark
    # driver of ESK_PROJECTIONS__DRIVER_MEMORY).
    run_in_dev: bool = True
    # A generation readers left (a rebuild switched them to a new one) is removed this long
    # after the switch, by the run keeping the new one: a read that chose the old one just
    # before has ended by then. `esk sql` reads the generation readers used as it started.
    old_generations_kept_s: float = Field(default=600.0, ge=0.0)
    # A continuous run that finds the generation readers use built by another version of
    # its read model (columns, partitioning, ReadModel.version) builds a new one from the
    # earliest offsets, readers staying on the old one until it has caught up; false: it is
    # refused, as a one-shot run is, until `esk project run NAME --rebuild`.
    rebuild_changed: bool = True
    # A batch that fails is probed for the event that fails it, and that event's aggregate
    # is held back (parked) from there, so that the others go on (projections.parking);
    # false: the batch fails, and the read model stops, until its code is fixed.
    park_failing_events: bool = True


class SubscriberSettings(BaseModel):
    """`esk subscriber NAME`: one subscription's process (each subscription declares its own
    retries; these are the process's bounds)."""

    # Where a DatabaseHandler without a database of its own keeps its SQLite file
    # (`<data_dir>/<name>.sqlite`).
    data_dir: Path = DATA_ROOT / "subscriptions"
    # Records fetched at a time, across the member's partitions; each partition's share is
    # handled in one transaction. Bigger is cheaper per record (a reactor's Kafka
    # transaction costs several round trips: docs/benchmarks.md, W6).
    batch_max_records: int = 5000
    # How long the broker may hold a fetch that finds nothing. A partition is paused while
    # its chunk is handled, and a client has one fetch in flight per broker: a partition
    # resumed behind a fetch held for Kafka's 500 ms waits that long for its next chunk
    # (docs/benchmarks.md, W6). An idle member asks this often.
    fetch_max_wait_ms: int = Field(default=20, ge=0)
    session_timeout_ms: int = 10_000
    max_poll_interval_ms: int = 300_000
    # On SIGTERM, and when a rebalance takes partitions away, how long the chunks in hand may
    # go on to their commit; one still running then is given up uncommitted, for the
    # partition's next owner to handle again. Keep it under the pod's
    # terminationGracePeriodSeconds (and esk dev's 30 s stop), and well under
    # max_poll_interval_ms: a rebalance waits for this member meanwhile.
    stop_grace_s: float = Field(default=20.0, ge=0)
    # Prometheus metrics, /healthz and /readyz of `esk subscriber` (None, in code alone: no
    # such server); `esk dev` gives each subscription's process the next port.
    metrics_port: int | None = 9465
    metrics_host: str = "127.0.0.1"


class TracingSettings(BaseModel):
    """OpenTelemetry tracing (esk.tracing): off by default, and then costs nothing."""

    enabled: bool = False
    # otlp: OTLP over HTTP (install esk[otlp]); console: every span on stdout; none: esk
    # installs no exporter, spans go to the TracerProvider the process has, if any.
    exporter: Literal["otlp", "console", "none"] = "otlp"
    # The OTLP traces URL, e.g. http://collector:4318/v1/traces; None: the exporter's own
    # default (OTEL_EXPORTER_OTLP_* variables, else localhost:4318).
    endpoint: str | None = None
    service_name: str | None = None  # default: "<app>-<process>", e.g. "esk-processor"
    # Of the traces that start in esk; one that arrives keeps the caller's decision.
    sample_ratio: float = Field(default=1.0, ge=0.0, le=1.0)


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="ESK_",
        env_nested_delimiter="__",
        env_file=".env",
        extra="ignore",
    )

    app: str = "esk"
    # Where the user's aggregate types live: "module:attribute" naming a list of
    # AggregateType, imported from the directory esk runs in.
    domain: str = "domain:AGGREGATES"
    # Where the user's read models live ("module:attribute" naming a list of Projection).
    read_models: str = "projections:READ_MODELS"
    # Where the user's subscriptions live ("module:attribute" naming a list of Reactor,
    # DatabaseHandler or SideEffectHandler).
    subscriptions: str = "subscriptions:SUBSCRIPTIONS"
    kafka: KafkaSettings = Field(default_factory=KafkaSettings)
    broker: BrokerSettings = Field(default_factory=BrokerSettings)
    topics: TopicSettings = Field(default_factory=TopicSettings)
    processor: ProcessorSettings = Field(default_factory=ProcessorSettings)
    api: ApiSettings = Field(default_factory=ApiSettings)
    projections: ProjectionSettings = Field(default_factory=ProjectionSettings)
    subscriber: SubscriberSettings = Field(default_factory=SubscriberSettings)
    tracing: TracingSettings = Field(default_factory=TracingSettings)
    log_level: str = "INFO"
    # "json": one JSON object a line (timestamp, level, logger, message, exception), for a
    # log collector; "text": one readable line.
    log_format: Literal["text", "json"] = "text"

    @property
    def bootstrap_servers(self) -> str:
        return self.kafka.bootstrap_servers or f"{self.broker.host}:{self.broker.port}"

    @property
    def uses_embedded_broker(self) -> bool:
        return self.kafka.bootstrap_servers is None


class SettingsInvalid(ValueError):
    """ESK_* variables (or .env) esk cannot take, each named as it is set."""


def read_settings() -> Settings:
    """The settings of ESK_* variables and .env; SettingsInvalid names each that is wrong,
    in a line (pydantic's own error names fields by their dotted path, over many lines)."""
    try:
        return Settings()
    except ValidationError as error:
        raise SettingsInvalid("; ".join(_told(e["loc"], e["msg"], e["type"], e.get("input")) for e in error.errors())) from None
    except SettingsError as error:  # a value that must be JSON and is not
        raise SettingsInvalid(_not_json(error)) from None


def _variable(path: typing.Sequence[str]) -> str:
    return "ESK_" + "__".join(path).upper()


def _told(loc: tuple[int | str, ...], message: str, kind: str, given: Any) -> str:
    path = [str(part) for part in loc if not isinstance(part, int)]
    item = next((f" (item {part})" for part in loc if isinstance(part, int)), "")
    told = f"{_as_set(path)}{item}: {message}"
    if kind == "missing" and isinstance(given, dict) and given:
        # set by a misspelt name, most often: the section's others are all it was given
        told += f" ({_variable(path[:-1])}__* sets only {', '.join(sorted(str(name).upper() for name in given))})"
    return told


def _as_set(path: list[str]) -> str:
    """The variable that set the field at `path`: its own, or a section's given whole as
    JSON (`ESK_API={"port": ...}`), the field named beside it."""
    environment = {name.upper() for name in os.environ}  # as pydantic reads them: any case
    for end in range(len(path), 0, -1):
        if _variable(path[:end]) in environment:
            return _variable(path[:end]) + (f" ({'.'.join(path[end:])})" if end < len(path) else "")
    return _variable(path)  # from .env, or missing


def _not_json(error: SettingsError) -> str:
    """The variables whose values are read as JSON (lists, mappings) and are not JSON."""
    wrong = []
    environment = {name.upper(): value for name, value in os.environ.items()}  # as pydantic reads them: any case
    for path in _json_fields(Settings, []):
        value = environment.get(_variable(path))
        if value is None:
            continue
        try:
            json.loads(value)
        except ValueError:
            wrong.append(_variable(path))
    if wrong:
        return f"{', '.join(wrong)}: not JSON (a section, a list or a mapping is read from JSON, e.g. [\"a\", \"b\"])"
    return str(error)  # from .env


# ESK_ variables esk reads that are no field of Settings.
_OTHER_VARIABLES = frozenset({"ESK_CACHE_DIR", "ESK_SPARK_SUBMITTED"})


def unknown_variables(env_file: str = ".env") -> list[str]:
    """The ESK_* variables set (in the environment, or in `env_file`) that name no setting,
    each with the one it may be a misspelling of: pydantic passes over them, and the setting
    meant keeps its default (a port, a broker's address) without a word."""
    known = {_variable(path) for path in _fields(Settings, [])} | _OTHER_VARIABLES
    # a mapping's entries may be set one by one (ESK_KAFKA__EXTRA__<KEY>)
    mappings = tuple(f"{_variable(path)}__" for path in _fields(Settings, [], _is_mapping))
    given, told = _esk_variables(env_file), []
    for name in sorted(given.keys() - known):
        if name.startswith(mappings):
            continue
        close = difflib.get_close_matches(name, known, n=1)
        told.append(f"{name}{given[name]} is no setting of esk{f': {close[0]}, perhaps' if close else ''}")
    return told


def _esk_variables(env_file: str = ".env") -> dict[str, str]:
    """The ESK_* variables set, in upper case as pydantic reads them, each with where: the
    environment (""), or `env_file`."""
    given = {name.upper(): "" for name in os.environ if name.upper().startswith("ESK_")}
    if Path(env_file).is_file():
        given |= {name.upper(): f" (in {env_file})" for name in dotenv_values(env_file) if name.upper().startswith("ESK_")}
    return given


def told_as_json() -> bool:
    """Whether ESK_LOG_FORMAT, in the environment or .env, asks for JSON: read alone, for an
    error in the other settings, which leaves the format unread."""
    value = next((v for k, v in os.environ.items() if k.upper() == "ESK_LOG_FORMAT"), None)
    if value is None and Path(".env").is_file():
        value = next((v for k, v in dotenv_values(".env").items() if k.upper() == "ESK_LOG_FORMAT"), None)
    return value == "json"


def _fields(model: type[BaseModel], path: list[str], wanted: Callable[[Any], bool] = lambda choice: True) -> typing.Iterator[list[str]]:
    """The paths of `model`'s fields, and of its sections' fields, whose type (or a type of
    its union) is `wanted`."""
    for name, field in model.model_fields.items():
        annotation = field.annotation
        choices = typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, types.UnionType) else (annotation,)
        if any(wanted(choice) for choice in choices):
            yield [*path, name]
        for choice in choices:
            if _is_section(choice):
                yield from _fields(choice, [*path, name], wanted)


def _is_section(choice: Any) -> bool:
    return isinstance(choice, type) and issubclass(choice, BaseModel)


def _is_mapping(choice: Any) -> bool:
    return typing.get_origin(choice) is dict


def _json_fields(model: type[BaseModel], path: list[str]) -> typing.Iterator[list[str]]:
    """The paths of `model`'s fields that a variable sets as JSON: sections (a section may be
    given whole), lists and mappings, nested ones too."""
    return _fields(model, path, lambda choice: _is_section(choice) or typing.get_origin(choice) in (list, dict))
