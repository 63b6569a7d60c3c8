"""The `esk` command line."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
import os
import re
import signal
import sys
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Iterable, Iterator
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer
from aiokafka.errors import KafkaError
from rich.console import Console
from rich.markup import escape

from .broker import BrokerError, EmbeddedBroker
from .kafka.acls import AUTHORIZATION_REFUSED, kafka_acls_script, refused_by_authorizer
from .kafka.client_options import KafkaAccessError, check_access
from .kafka.topics import TopicNames, TopicSpec, coordinators_ready, ensure_topics, missing_topics, topic_specs
from .logs import configure_logging
from .registry import ImportFailed, Registry, SettingMistake, load_registry
from .schema.lock import LOCK_FILE, Lock, LockError, build_lock, project_lock, read_lock, write_lock
from .settings import Settings, SettingsInvalid, read_settings, told_as_json, unknown_variables

if TYPE_CHECKING:
    from rich.table import Table

    from .projections.catalog import Projection
    from .schema.check import Finding
    from .subscriptions.api import AnySubscription
    from .subscriptions.parking import ParkedEvent


def _commands(help: str, **options: Any) -> typer.Typer:
    # Help as click prints it: rich's panels keep the docstrings' line breaks in a group's
    # list of commands, and name a flag's type `<bool>`.
    return typer.Typer(no_args_is_help=True, rich_markup_mode=None, help=help, **options)


cli = _commands("esk: event sourcing and CQRS on Apache Kafka.", add_completion=False)
broker_cli = _commands("The embedded single-node Kafka broker (KRaft).")
topics_cli = _commands("The application's topics.")
cli.add_typer(broker_cli, name="broker")
project_cli = _commands("PySpark projections: read models in Delta Lake.")
cli.add_typer(topics_cli, name="topics")
cli.add_typer(project_cli, name="project")
schema_cli = _commands("The schemas of commands, events and states: the lock file CI checks.")
cli.add_typer(schema_cli, name="schema")
state_cli = _commands("The processor's stored aggregate states.")
cli.add_typer(state_cli, name="state")
subscriptions_cli = _commands("Subscriptions: their lag, parked events, retries and replays.")
cli.add_typer(subscriptions_cli, name="subscriptions")

# soft_wrap: a line printed to a pipe or a log file stays one line (rich would otherwise wrap
# it at 80 columns), as a log collector reads it; tables still fit the width.
# No emoji codes: ":X:" in a setting (ESK_DOMAIN=pkg.mod:X) would print as an emoji.
console = Console(soft_wrap=True, emoji=False)


class Output(StrEnum):
    """How a listing is printed (`--format`)."""

    TABLE = "table"
    CSV = "csv"
    JSON = "json"


def _output_option(each: str) -> Any:
    return typer.Option("--format", help=f"json is JSON Lines, {each} a line.")


err = Console(stderr=True, soft_wrap=True, emoji=False)
log = logging.getLogger("esk.cli")
T = TypeVar("T")
# Set by load_settings: with ESK_LOG_FORMAT=json, an error that ends a command is a JSON
# line of the log too, not text among them.
_errors_as_json = False


def load_settings(**overrides: Any) -> Settings:
    """ESK_* variables and .env first; flags that were given override them."""
    global _errors_as_json
    try:
        settings = read_settings()
    except SettingsInvalid as error:
        if told_as_json():  # a log pipeline reads JSON, this line too
            configure_logging("INFO", "json")
            _errors_as_json = True
        raise fail(str(error)) from None
    for dotted, value in overrides.items():
        if value is None:
            continue
        section, _, name = dotted.partition("__")
        if name:
            part = getattr(settings, section).model_copy(update={name: value})
            settings = settings.model_copy(update={section: part})
        else:
            settings = settings.model_copy(update={section: value})
    configure_logging(settings.log_level, settings.log_format)
    _errors_as_json = settings.log_format == "json"
    from .runtime import DEV_CHILD_VARIABLE

    if DEV_CHILD_VARIABLE not in os.environ:  # esk dev said it, for each process it starts
        for told in unknown_variables():
            log.warning(f"{told}: it is passed over")
    return settings


def fail(message: str) -> typer.Exit:
    # One line whatever the width: rich would otherwise wrap at 80 columns when stderr is
    # not a terminal (CI, a log file). Escaped: a message may hold brackets, e.g. a path.
    if _errors_as_json:
        log.error(message)
    else:
        err.print(f"[red]error:[/red] {escape(message)}", highlight=False, soft_wrap=True)
    return typer.Exit(code=1)


def domain_registry(settings: Settings) -> Registry:
    """The user's aggregate types (ESK_DOMAIN), or a one-line error instead of a traceback
    when they cannot be found: the usual first mistake of a new project."""
    try:
        return load_registry(settings.domain)
    except (LookupError, SettingMistake, ImportFailed) as error:  # their messages name the setting and what to do
        raise fail(str(error)) from None
    except ImportError as error:  # the module exists, but something it imports does not
        raise fail(f"ESK_DOMAIN={settings.domain}: {error}") from None


# How often a long-running process asks again for a broker that is down as it starts.
KAFKA_WAIT_S = 2.0
TOPICS_WAIT_TOLD_EVERY_S = 60.0  # a process waiting for its topics says so again this often


def require_kafka_access(settings: Settings, needed_by: str | None = None, wait: bool = False) -> None:
    """A broker that refuses esk's clients (TLS, SASL) is a one-line error before any of
    them starts: theirs would be "Unable to bootstrap", with the reason only in a log line.
    Given `needed_by` (what cannot wait for one), so is a broker that does not answer; with
    `wait` (a long-running process, whose clients fail at once at their start), it is
    waited for."""
    told = False
    with _ended_by_sigterm() if wait else contextlib.nullcontext():
        while True:
            try:
                answered = asyncio.run(check_access(settings))
            except KafkaAccessError as error:
                raise fail(str(error)) from None
            if answered or not (needed_by or wait):
                break
            if needed_by:
                raise fail(
                    f"no Kafka broker answered at {settings.bootstrap_servers}, which {needed_by} needs: start one "
                    "(`esk broker start`; `esk dev` starts its own), or set ESK_KAFKA__BOOTSTRAP_SERVERS to yours"
                )
            if not told:
                log.warning("no Kafka broker answers at %s yet: waiting for one (Ctrl-C stops)", settings.bootstrap_servers)
                told = True
            time.sleep(KAFKA_WAIT_S)
    if told:
        log.info("Kafka at %s answers: starting", settings.bootstrap_servers)


def require_topics(settings: Settings, names: list[str]) -> None:
    """A long-running process started beside `esk topics init` (a Job, a script) waits for
    the topics it reads and writes, as it waits for a broker: its clients would log an
    ERROR ten times a second for 30 s, then fail with a traceback."""
    told: float | None = None
    with _ended_by_sigterm():
        while True:
            try:
                with told_when_refused(settings):
                    missing = asyncio.run(missing_topics(settings, names))
            except (KafkaError, OSError) as error:  # the broker gone again meanwhile: asked again
                log.debug("the topics could not be listed: %r", error)
                missing = None
            if missing == []:
                break
            if missing and (told is None or time.monotonic() - told >= TOPICS_WAIT_TOLD_EVERY_S):
                log.warning("no topic %s yet: waiting for `esk topics init` (Ctrl-C stops)", ", ".join(missing))
                told = time.monotonic()
            time.sleep(KAFKA_WAIT_S)
    if told is not None:
        log.info("the topics are there: starting")


@contextlib.contextmanager
def told_when_refused(settings: Settings) -> Iterator[None]:
    """An ACL missing on a cluster with an authorizer is a one-line error that names the
    command printing esk's ACLs: the clients' own would be a traceback."""
    try:
        yield
    except AUTHORIZATION_REFUSED as error:
        raise fail(refused_by_authorizer(settings, error)) from None


def tell_refused_topics(settings: Settings, names: list[str]) -> None:
    """A topic of `names` the principal may not describe is an ACL missing: told in a line
    (`told_when_refused`). Missing topics are not waited for, and a broker gone meanwhile is
    the caller's clients' to wait out."""
    with contextlib.suppress(KafkaError, OSError), told_when_refused(settings):
        asyncio.run(missing_topics(settings, names))


@contextlib.contextmanager
def _ended_by_sigterm() -> Iterator[None]:
    """A process that waits to start ends at SIGTERM (a pod deleted, `docker stop`) as it
    does once running: cleanly, exit 0, rather than killed by the signal."""

    def end(signum: int, frame: object) -> None:
        raise SystemExit(0)

    previous = signal.signal(signal.SIGTERM, end)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


PortOption = Annotated[int | None, typer.Option("--port", help="Broker port (ESK_BROKER__PORT).")]
DataDirOption = Annotated[Path | None, typer.Option("--data-dir", help="Broker data directory.")]


@broker_cli.command("start")
def broker_start(port: PortOption = None, data_dir: DataDirOption = None) -> None:
    """Start the broker (format its storage the first time); return once it answers."""
    settings = load_settings(broker__port=port, broker__data_dir=data_dir)
    try:
        status = EmbeddedBroker(settings.broker).start()
    except BrokerError as error:
        raise fail(str(error)) from None
    console.print(f"broker {status.describe()}")


@broker_cli.command("stop")
def broker_stop(port: PortOption = None, data_dir: DataDirOption = None) -> None:
    """Stop the broker gracefully; its data stays."""
    settings = load_settings(broker__port=port, broker__data_dir=data_dir)
    stopped = EmbeddedBroker(settings.broker).stop()
    console.print("broker stopped" if stopped else "broker was not running")


@broker_cli.command("status")
def broker_status(port: PortOption = None, data_dir: DataDirOption = None) -> None:
    """Say whether the broker runs and answers; exit 1 when it does not."""
    settings = load_settings(broker__port=port, broker__data_dir=data_dir)
    status = EmbeddedBroker(settings.broker).status()
    console.print(f"broker {status.describe()}")
    if not (status.running and status.answering):
        raise typer.Exit(code=1)


@topics_cli.command("init")
def topics_init(
    partitions: Annotated[int | None, typer.Option(help="Partitions per topic (ESK_TOPICS__PARTITIONS).")] = None,
) -> None:
    """Create the application's topics, or check the ones that exist; exit 1 on any mismatch."""
    from .subscriptions.api import DatabaseHandler
    from .subscriptions.parked_topic import parked_topic_spec

    settings = load_settings(topics__partitions=partitions)
    # The Kafka kinds' parked topics too, which each subscriber makes at its start
    # otherwise: a principal that may not create topics runs them once an admin ran this.
    parked = [parked_topic_spec(settings, name) for name, s in configured_subscriptions(settings).items() if not isinstance(s, DatabaseHandler)]
    init_topics(settings, parked)


def init_topics(settings: Settings, more: list[TopicSpec] | None = None) -> None:
    registry = domain_registry(settings)
    require_kafka_access(settings, "making or checking the topics")
    try:
        with told_when_refused(settings):
            report = asyncio.run(ensure_topics(settings, [*topic_specs(settings, registry), *(more or [])]))
    except (KafkaError, TimeoutError) as error:  # no answer after a minute of asking
        raise fail(f"making or checking the topics failed: {error!r}") from None
    if (unanswered := asyncio.run(coordinators_ready(settings))) is not None:
        why = refused_by_authorizer(settings, unanswered) if isinstance(unanswered, AUTHORIZATION_REFUSED) else repr(unanswered)
        err.print(f"[yellow]warning:[/yellow] the group and transaction coordinators did not answer: {escape(why)}", highlight=False, soft_wrap=True)
    for name in report.created:
        console.print(f"created  {name}")
    for name in report.ok:
        console.print(f"ok       {name}")
    for problem in report.problems:
        err.print(f"[red]problem[/red]  {problem}", highlight=False)
    if report.problems:
        raise fail("topics do not match the settings; fix them (or the settings) and run again")


@topics_cli.command("acls")
def topics_acls(
    principal: Annotated[str, typer.Option(help="Who runs esk's processes, as the cluster names it: User:<name>.")],
) -> None:
    """Print the kafka-acls commands that let PRINCIPAL run every esk process of this app (on a
    cluster whose authorizer refuses what no ACL allows); run them as a principal allowed to
    change ACLs, with its --command-config."""
    settings = load_settings()
    for line in kafka_acls_script(settings, principal):
        console.print(line, highlight=False, soft_wrap=True, markup=False)


@cli.command("processor")
def processor() -> None:
    """Run the processor (production entry point): one task per assigned commands partition."""
    from .health import CannotListen
    from .processes import HeldElsewhere
    from .runtime import run_processor
    from .schema.recorded import SchemasContradicted

    settings = load_settings()
    registry = domain_registry(settings)  # fails in one line here; the runtime loads it again (cached)
    _refuse_stored_events_contradicted(registry)

    def wait() -> None:
        require_kafka_access(settings, wait=True)
        require_topics(settings, [spec.name for spec in topic_specs(settings, registry)])

    try:
        with told_when_refused(settings):
            run_processor(settings, wait)
    except SchemasContradicted as error:
        for line in error.told:
            err.print(f"  {escape(line)}", highlight=False, soft_wrap=True)
        raise fail(str(error)) from None
    except HeldElsewhere as error:
        raise fail(f"another processor{error.holder} runs over {settings.processor.state_dir}: give each its own ESK_PROCESSOR__STATE_DIR") from None
    except CannotListen as error:
        raise fail(f"{error}: give each processor on this host its own ESK_PROCESSOR__METRICS_PORT") from None


@cli.command("api")
def api(
    host: Annotated[str | None, typer.Option(help="Listen address (ESK_API__HOST).")] = None,
    port: Annotated[int | None, typer.Option(help="Listen port (ESK_API__PORT).")] = None,
) -> None:
    """Run the HTTP API (production entry point)."""
    from .health import CannotListen
    from .processes import HeldElsewhere
    from .runtime import run_api

    settings = load_settings(api__host=host, api__port=port)
    registry = domain_registry(settings)  # fails in one line here; the runtime loads it again (cached)

    def wait() -> None:
        require_kafka_access(settings, wait=True)
        # the API starts before `esk topics init` has run: only what it may not see is told
        tell_refused_topics(settings, [spec.name for spec in topic_specs(settings, registry)])

    try:
        with told_when_refused(settings):
            run_api(settings, wait)
    except HeldElsewhere as error:
        raise fail(f"another API{error.holder} runs over {settings.api.state_dir}: give each its own ESK_API__STATE_DIR") from None
    except CannotListen as error:
        raise fail(f"{error}: give each API on this host its own ESK_API__PORT (or --port)") from None


@cli.command("subscriber")
def subscriber(name: Annotated[str, typer.Argument(help="A subscription (see `esk subscriptions list`).")]) -> None:
    """Run one subscription (production entry point); several processes share its partitions."""
    from .health import CannotListen
    from .runtime import run_subscriber
    from .subscriptions.routing import Router

    settings = load_settings()
    registry = domain_registry(settings)  # fails in one line here; the runtime loads it again (cached)
    subscription = subscription_named(settings, name)

    def wait() -> None:
        require_kafka_access(settings, wait=True)
        require_topics(settings, Router(subscription, registry, settings.app).topics)

    try:
        with told_when_refused(settings):
            run_subscriber(settings, name, wait)
    except CannotListen as error:
        raise fail(f"{error}: give each subscriber on this host its own ESK_SUBSCRIBER__METRICS_PORT") from None


@cli.command("dev")
def dev(
    reload: Annotated[bool, typer.Option("--reload/--no-reload", help="Start the processes again when the project's code changes.")] = True,
) -> None:
    """Everything on one machine: embedded broker (unless ESK_KAFKA__BOOTSTRAP_SERVERS is set),
    topics, processor, API, a subscriber per subscription and the read models (one Spark
    driver), started again when the project's code changes. Ctrl-C (or SIGTERM) stops all of it."""
    from .code_watch import CodeWatch, imported_files, project_sources
    from .processes import HeldElsewhere
    from .runtime import hold_dev_lock, run_dev, run_dev_reloading

    # SIGTERM (docker stop, systemd, a supervisor) stops everything as Ctrl-C does; by
    # default it would end this process alone and leave the processor and API running.
    # SIGINT too, explicitly: a process started in the background by a shell inherits SIGINT
    # ignored, and Python then leaves it ignored, so Ctrl-C (or `kill -INT`) did nothing.
    for stop_signal in (signal.SIGINT, signal.SIGTERM):
        signal.signal(stop_signal, signal.default_int_handler)
    settings = load_settings()
    try:
        hold_dev_lock(settings)
    except HeldElsewhere as error:
        raise fail(
            f"esk dev runs here already{error.holder}, over {settings.processor.state_dir}: stop it first, "
            "or give this one a state directory and ports of its own (ESK_PROCESSOR__STATE_DIR, ESK_API__PORT, …)"
        ) from None
    except OSError as error:
        raise fail(f"cannot use {settings.processor.state_dir}: {error.strerror}") from None
    registry = domain_registry(settings)  # before the broker starts: a wrong ESK_DOMAIN costs no broker start
    subscriptions = list(configured_subscriptions(settings))
    projections = dev_read_models(settings)
    sources = project_sources(settings, Path.cwd(), imported_files()) if reload else []
    if reload and not sources:
        console.print(
            f"not watching for changes: none of {settings.domain}, {settings.read_models}, {settings.subscriptions} "
            f"is a package or module under {Path.cwd()} (start esk dev again after a change)",
            highlight=False,
        )
    broker = EmbeddedBroker(settings.broker) if settings.uses_embedded_broker else None
    started_broker = False
    if broker is not None:
        try:
            started_broker = not broker.status().running
            console.print(f"broker {broker.start().describe()}")
        except BrokerError as error:
            raise fail(str(error)) from None
    try:
        if sources:
            # The processes below a parent of their own, which a change ends and starts again:
            # a new process imports the project's code, its topics and processes, as they are.
            console.print(f"watching {', '.join(map(str, sources))}: a change starts the processes again", highlight=False)
            watch = CodeWatch(sources).start()
            try:
                code = run_dev_reloading(settings, watch)
            finally:
                watch.stop()
        else:
            _warn_of_stored_events_broken(registry)
            init_topics(settings)
            console.print(
                f"API on http://{settings.api.host}:{settings.api.port} (docs: /docs); Ctrl-C stops everything",
                highlight=False,
            )
            if projections:
                console.print(f"read models, kept up by one Spark driver: {', '.join(projections)}", highlight=False)
            code = run_dev(settings, subscriptions, read_models=bool(projections))
    finally:
        if broker is not None and started_broker:
            broker.stop()
            console.print("broker stopped")
    if code:
        raise typer.Exit(code)


@project_cli.command("list")
def project_list(
    output: Annotated[Output, _output_option("a read model")] = Output.TABLE,
) -> None:
    """The read models, what they read, the generation readers use, how far it has read, and
    the runs keeping them."""
    from .projections.catalog import Tables
    from .projections.positions import Position, read_model_positions

    settings = load_settings()
    tables = Tables(settings.projections.warehouse_dir)
    columns = ["name", "reads", "description", "current_table", "reflects", "kept_by", "parked"]
    rows: list[list[Any]] = []
    for model in (p.model for p in read_models(settings).values()):
        current = tables.current_generation(model.name)
        path = tables.current_path(model.name)
        positions = read_model_positions(tables, model.name) or {}
        reflects = [Position(t, p, o).token() for (t, p), o in sorted(positions.items())]
        kept = tables.keepers(model.name)
        keepers = [
            (holder if generation == current else f"building g{generation}: {holder}")
            + (f" (held up: {kept.held_up[generation]})" if generation in kept.held_up else "")
            for generation, holder in kept.runs.items()
        ]
        if kept.left_out is not None:
            keepers.append(f"left out by {kept.left_out.who} ({kept.left_out.held_up})")
        parked = len(tables.parked_in(model.name, current))
        rows.append([model.name, list(model.categories), model.description, str(path) if path else None, reflects, keepers, parked])
    if output != "json":  # a cell of text: lists on lines of their own, nothing said plainly
        for row in rows:
            row[1:] = [", ".join(row[1]), row[2], row[3] or "not built yet", " ".join(row[4]), "\n".join(row[5]) or "no run", str(row[6])]
    print_rows(columns, rows, output)


@project_cli.command("parked")
def project_parked(
    name: Annotated[str, typer.Argument(help="The read model.")],
    output: Annotated[Output, _output_option("an aggregate")] = Output.TABLE,
    generation: Annotated[
        int | None, typer.Option("--generation", help="Another generation than the one readers use: a rebuild on its way.")
    ] = None,
) -> None:
    """The aggregates the read model holds back: an event of each failed its batch, and its
    events from there on wait out of the table until a rebuild (after a fix, a raised
    ReadModel.version, or `esk project run NAME --rebuild`) takes them in again."""
    from .projections.catalog import Tables, select_read_models

    settings = load_settings()
    try:
        select_read_models(read_models(settings), [name], False)
    except ValueError as error:
        raise fail(str(error)) from None
    tables = Tables(settings.projections.warehouse_dir)
    if generation is not None and generation not in (generations := tables.generations(name)):
        raise fail(f"{name} has no generation {generation} (it has: {', '.join(map(str, generations)) or 'none'})")
    parked = tables.parked_in(name, tables.current_generation(name) if generation is None else generation)
    columns = ["aggregate_type", "aggregate_id", "event_type", "partition", "offset", "batch", "parked_at", "reason"]
    rows: list[list[Any]] = [
        [p.aggregate_type, p.aggregate_id, p.event_type, p.partition, p.offset, p.batch_id,
         _utc_ms(p.parked_at), p.reason]
        for p in parked
    ]
    print_rows(columns, rows, output)


@project_cli.command("run")
def project_run(
    names: Annotated[list[str] | None, typer.Argument(metavar="NAME...", help="Read models (see `esk project list`), run together in one driver.", show_default=False)] = None,
    every: Annotated[bool, typer.Option("--all", help="Every read model the project has.")] = False,
    continuous: Annotated[bool, typer.Option("--continuous", help="Keep running after catching up.")] = False,
    rebuild: Annotated[bool, typer.Option("--rebuild", help="Rebuild from the earliest offsets into a new table; readers switch once it caught up.")] = False,
    leave_out_invalid: Annotated[
        bool, typer.Option("--leave-out-invalid", help="A read model whose reads or plan are wrong, or that fails in Spark on every aggregate, is told and left out, the others going on; exit 1 at the end.")
    ] = False,
) -> None:
    """Catch read models up with their event streams (and stop, unless --continuous)."""
    from .projections.catalog import select_read_models
    from .projections.runner import RunFailed, run_and_report, stop_on_signals

    settings = load_settings()
    projections = read_models(settings)
    try:
        chosen = select_read_models(projections, names or [], every)
    except ValueError as error:
        raise fail(str(error)) from None
    # A continuous run waits for a broker away, as every long-running process does (at its
    # start here, later as its query gives up); a one-shot run ends at once.
    require_kafka_access(settings, None if continuous else "a run that is not --continuous", wait=continuous)
    # an ACL missing told here, not in the Java trace of a query that fails after Spark's start
    topics = TopicNames(settings.app)
    tell_refused_topics(settings, sorted({topics.events(c) for p in chosen for c in p.model.categories}))
    try:
        code = run_and_report(settings, chosen, continuous, rebuild, console, stop_on_signals(), leave_out_invalid)
    except RunFailed as failed:
        raise fail(str(failed)) from failed.error
    if code:
        raise typer.Exit(code)


@cli.command("sql")
def sql(
    query: Annotated[str, typer.Argument(help='e.g. "SELECT * FROM customer_recent_orders WHERE customer_id = \'c1\'"')],
    output: Annotated[Output, _output_option("a row")] = Output.TABLE,
    limit: Annotated[int, typer.Option(help="Rows printed at most.")] = 1000,
) -> None:
    """Run Spark SQL over the read models; each is a table under its own name."""
    from .projections.catalog import Tables
    from .projections.session import spark_session

    settings = load_settings()
    known = list(read_models(settings))
    if not known:  # before Spark's start: seconds to tell nothing can be found
        raise fail(f"no read models to query: ESK_READ_MODELS={settings.read_models} names none (from {Path.cwd()})")
    spark = spark_session(settings, "esk-sql")
    tables = Tables(settings.projections.warehouse_dir)
    for name in named_in(query, known):
        path = tables.current_path(name)
        if path is not None:
            spark.read.format("delta").load(str(path)).createOrReplaceTempView(name)
    try:
        frame = spark.sql(query).limit(limit)
        rows = frame.collect()
    except Exception as error:  # Spark's analysis errors name the missing table or column
        told = str(error).splitlines()[0]
        if "TABLE_OR_VIEW_NOT_FOUND" in told:
            told += f" (the read models: {', '.join(sorted(known))}; one never run has no table yet)"
        raise fail(told) from None
    print_rows(frame.columns, [list(r) for r in rows], output)


def named_in(query: str, names: Iterable[str]) -> list[str]:
    """The `names` a query names, as a word in any case (Spark's names are not case
    sensitive): only their tables are loaded, as loading one reads its Delta log (seconds
    for a table a continuous run has committed to for long)."""
    return [name for name in names if re.search(rf"(?<![\w$]){re.escape(name)}(?![\w$])", query, re.IGNORECASE)]


def dev_read_models(settings: Settings) -> list[str]:
    """The read models `esk dev` keeps up: all of the project's, unless it was told not to
    (ESK_PROJECTIONS__RUN_IN_DEV) or Spark is not installed, which it says if the project
    has read models (once: not again in the processes' parent that a reload starts anew)."""
    from .runtime import DEV_CHILD_VARIABLE

    if not settings.projections.run_in_dev:
        return []
    if importlib.util.find_spec("pyspark") is None:
        if DEV_CHILD_VARIABLE not in os.environ and _module_there(settings.read_models.partition(":")[0]):
            console.print("read models are not kept up: they need the spark extra (pip install 'esk[spark]')", highlight=False, markup=False)
        return []
    return list(read_models(settings))


def _module_there(name: str) -> bool:
    try:
        return bool(name) and importlib.util.find_spec(name) is not None
    except ImportError:  # a parent package that is not there
        return False


def read_models(settings: Settings) -> dict[str, Projection]:
    """The user's read models (ESK_READ_MODELS), or a one-line error."""
    from .projections.catalog import configured_read_models, needs_spark_extra

    try:
        return configured_read_models(settings)
    except (LookupError, TypeError, ValueError, ImportFailed) as error:  # their messages name the setting
        raise fail(str(error)) from None
    except ImportError as error:
        hint = " (the read models need the spark extra: pip install 'esk[spark]')" if needs_spark_extra(error) else ""
        raise fail(f"ESK_READ_MODELS={settings.read_models}: {error}{hint}") from None


@cli.command("jars")
def jars(
    jar_set: Annotated[str, typer.Argument(help="kafka (the embedded broker) or spark (the read models)")],
) -> None:
    """Resolve a set of jars into the cache (from Maven Central, the first time) and print its
    folder; for spark, also make the local driver's class archive (once, tens of seconds)."""
    from .jars import JarsError, jars_dir

    settings = load_settings()
    configured = {"kafka": settings.broker.jars_dir, "spark": settings.projections.jars_dir}.get(jar_set)
    try:
        folder = jars_dir(jar_set, configured)
    except JarsError as error:
        raise fail(str(error)) from None
    if jar_set == "spark" and importlib.util.find_spec("pyspark") is not None:  # without pyspark, no driver to speed up
        from .projections.class_archive import make_archive
        from .projections.session import extra_jars

        try:
            make_archive(extra_jars(configured))
        except RuntimeError as error:  # sessions still run, only without the archive
            err.print(f"[yellow]warning:[/yellow] {escape(str(error))}", highlight=False, soft_wrap=True)
    print(folder)


LockFileOption = Annotated[Path, typer.Option("--file", help="The lock file.")]


def _stored_events_broken_here(registry: Registry) -> list[Finding] | None:
    """What the project's lock file (in the directory esk runs in) says the code breaks of
    the events stored under it: none without a lock file; None, said in a warning, when it
    cannot be checked (a lock it cannot read, a model with no JSON Schema: `esk schema
    check` tells that in CI, and a start is not stopped by it)."""
    try:
        return stored_events_broken(registry, read_lock()) if LOCK_FILE.exists() else []
    except Exception as error:
        err.print(f"[yellow]warning:[/yellow] {LOCK_FILE} not checked: {escape(str(error))}", highlight=False)
        return None


def _warn_of_stored_events_broken(registry: Registry) -> None:
    """esk dev's word, as its processes start, on a change to the events that the project's
    lock file says breaks those stored: the processor would write the new shape under the
    old version (esk dev's data is the developer's: a word, not a stop)."""
    broken = _stored_events_broken_here(registry) or []
    for finding in broken:
        err.print(f"[yellow]warning:[/yellow] {escape(str(finding))}", highlight=False)
    if broken:
        err.print(f"[yellow]warning:[/yellow] {LOCK_FILE}: the events stored under it would no longer all be read (`esk schema check`)", highlight=False)


def _refuse_stored_events_contradicted(registry: Registry) -> None:
    """The processor's start, when the project's lock file says the code would write events
    of a shape that contradicts those stored under the same schema version: the two could
    never be told apart again. (What else breaks the stored events, a missing or failing
    upcaster, is `esk schema check`'s to catch, and the aggregates it hits are told
    unusable one by one.) Under esk dev, which warns instead, it starts."""
    from .runtime import DEV_CHILD_VARIABLE

    if DEV_CHILD_VARIABLE in os.environ:
        return
    contradicting = [finding for finding in _stored_events_broken_here(registry) or [] if finding.contradicts_stored]
    for finding in contradicting:
        err.print(f"  {escape(str(finding))}", highlight=False, soft_wrap=True)
    if contradicting:
        raise fail(
            f"{LOCK_FILE}: this code would write events under schema versions that stored ones of the same version "
            "contradict (above): give the changed events a new schema version and an upcaster, or, if no such event was "
            "ever stored, lock the code as it is (`esk schema lock --force`)"
        )


def stored_events_broken(registry: Registry, lock: Lock) -> list[Finding]:
    """What `esk schema check` finds in the code that breaks the events stored under `lock`."""
    from .schema.check import check

    return [f for f in check(registry, lock) if breaks_stored_events(f)]


def _against_recorded(settings: Settings, registry: Registry) -> list[Finding]:
    """Each event version the code writes that `<app>.schemas` holds with another shape."""
    from .kafka.metadata import TopicMissing
    from .schema.check import Finding, Severity
    from .schema.recorded import contradictions, recorded_schemas, written_schemas

    require_kafka_access(settings, "--recorded")
    topic = TopicNames(settings.app).schemas
    try:
        with told_when_refused(settings):
            held = asyncio.run(recorded_schemas(settings))
    except TopicMissing:
        held = {}  # no processor ever ran: nothing stored
    return [Finding(Severity.BREAKING, "", "event", "", "", told) for told in contradictions(written_schemas(registry), held, topic)]


def breaks_stored_events(finding: Finding) -> bool:
    """A breaking finding that `esk schema lock` refuses: a lock cannot make the events
    stored under the old one readable again (a command change only breaks clients)."""
    from .schema.check import Severity

    return finding.severity is Severity.BREAKING and finding.subject in ("aggregate", "event")


@schema_cli.command("lock")
def schema_lock(
    file: LockFileOption = LOCK_FILE,
    force: Annotated[
        bool, typer.Option("--force", help="Lock even changes that break the events stored under the lock: only for events never stored.")
    ] = False,
) -> None:
    """Write the JSON Schema of every command, event and state to the lock file, for you to
    commit. A change that breaks the events stored under the lock is refused: a lock cannot
    make them readable again (a command change that breaks clients is taken)."""
    settings = load_settings()
    registry = domain_registry(settings)
    try:
        # The previous lock holds the schemas of events' earlier versions: the new one keeps them.
        previous = read_lock(file) if file.exists() else None
        if previous is not None and not force:
            stored = stored_events_broken(registry, previous)
            for finding in stored:
                err.print(f"  {escape(str(finding))}", highlight=False, soft_wrap=True)
            if stored:
                raise fail(
                    f"{file} not written: {len(stored)} {'change breaks' if len(stored) == 1 else 'changes break'} the events "
                    f"stored under it (above); mend the code, or lock with --force if no such event was ever stored"
                )
        lock = build_lock(registry, previous)
    except LockError as error:
        raise fail(str(error)) from None
    try:
        write_lock(lock, file)
    except OSError as error:
        raise fail(f"cannot write {file}: {error.strerror}") from None
    commands = sum(len(a.commands) for a in lock.aggregates.values())
    events = sum(len(a.events) for a in lock.aggregates.values())
    console.print(f"wrote {file}: aggregate types {len(lock.aggregates)}, commands {commands}, event types {events}", highlight=False)


@schema_cli.command("check")
def schema_check(
    file: LockFileOption = LOCK_FILE,
    recorded: Annotated[
        bool,
        typer.Option(
            "--recorded",
            help="Also against the event schemas the brokers hold (<app>.schemas): what a release stored that this lock does not know (after a rollback).",
        ),
    ] = False,
) -> None:
    """Compare the code with the lock file; exit 1 on a change that breaks stored events or HTTP clients."""
    from .schema.check import Severity, check

    settings = load_settings()
    registry = domain_registry(settings)
    try:
        findings = check(registry, read_lock(file))
    except LockError as error:
        raise fail(str(error)) from None
    if recorded:
        findings += _against_recorded(settings, registry)
    colors = {Severity.BREAKING: "red", Severity.COMPATIBLE: "green", Severity.INFO: "blue"}
    for severity in Severity:
        group = [f for f in findings if f.severity is severity]
        if group:
            console.print(f"[{colors[severity]}]{severity}[/]:", highlight=False)
        for finding in group:
            console.print(f"  {escape(str(finding))}", highlight=False, soft_wrap=True)
    breaking = sum(f.severity is Severity.BREAKING for f in findings)
    if breaking:
        stored = sum(breaks_stored_events(f) for f in findings)
        if stored == 0:
            what = "a command change meant to break clients is accepted by running `esk schema lock`"
        elif stored == breaking:
            they = "it breaks" if breaking == 1 else "they break"
            what = f"{they} the events stored under it: mend the code, as `esk schema lock` refuses {'it' if breaking == 1 else 'them'}"
        else:
            what = f"{stored} of them break the events stored under it: mend the code, as `esk schema lock` refuses them"
        raise fail(f"{breaking} breaking {'change' if breaking == 1 else 'changes'} against {file} ({what})")
    console.print(f"{file}: no breaking change" if findings else f"{file}: the code matches it", highlight=False)


@schema_cli.command("asyncapi")
def schema_asyncapi(
    file: Annotated[Path | None, typer.Option("--file", help="Write it to this file instead of standard output.")] = None,
) -> None:
    """The AsyncAPI 3 document of the event topics: a channel per aggregate type, a message per event type."""
    import orjson

    from .schema.asyncapi import asyncapi_document

    settings = load_settings()
    try:
        lock = project_lock()
    except LockError as error:
        raise fail(str(error)) from None
    text = orjson.dumps(asyncapi_document(settings, domain_registry(settings), lock), option=orjson.OPT_INDENT_2).decode() + "\n"
    if file is None:
        typer.echo(text, nl=False)
    else:
        file.write_text(text)
        console.print(f"wrote {file}", highlight=False)


@state_cli.command("unusable")
def state_unusable() -> None:
    """The aggregates whose events do not fold into the current state model, and why (read
    from the changelog); exit 1 when there are any. Their commands are refused until a start
    of fixed code rebuilds them."""
    from .processing.state_rebuild import unusable_aggregates

    settings = load_settings()
    require_kafka_access(settings, "reading the changelog")
    found = asyncio.run(unusable_aggregates(settings))
    for (aggregate_type, aggregate_id), reason in sorted(found.items()):
        console.print(f"{aggregate_type}/{aggregate_id}: {escape(reason)}", highlight=False, soft_wrap=True)
    if not found:
        console.print("no unusable aggregates", highlight=False)
    else:  # a gate a deploy or a health check can run: as grep, found is 1
        raise typer.Exit(1)


def configured_subscriptions(settings: Settings) -> dict[str, AnySubscription]:
    """The user's subscriptions (ESK_SUBSCRIPTIONS), or a one-line error."""
    from .subscriptions.catalog import configured_subscriptions as configured

    try:
        return configured(settings)
    except (LookupError, TypeError, ValueError, ImportFailed) as error:  # their messages name the setting
        raise fail(str(error)) from None
    except ImportError as error:
        raise fail(f"ESK_SUBSCRIPTIONS={settings.subscriptions}: {error}") from None


def subscription_named(settings: Settings, name: str) -> AnySubscription:
    found = configured_subscriptions(settings)
    if name not in found:
        known = ", ".join(found) or "none"
        raise fail(f"no subscription {name!r} (the application has: {known}; ESK_SUBSCRIPTIONS={settings.subscriptions})")
    return found[name]


def subscription_operations(settings: Settings, name: str) -> Any:
    from .subscriptions.operations import SubscriptionOperations

    subscription = subscription_named(settings, name)
    require_kafka_access(settings, "looking at or changing a subscription")
    try:
        return SubscriptionOperations(settings, subscription, domain_registry(settings))
    except ValueError as error:
        raise fail(str(error)) from None


NameArgument = Annotated[str, typer.Argument(help="A subscription (see `esk subscriptions list`).")]
AggregateOption = Annotated[str | None, typer.Option("--aggregate", help="Only this aggregate id's parked events.")]
ByOption = Annotated[str | None, typer.Option("--by", help="Who does it, for the record (default: the OS user).")]


@subscriptions_cli.command("list")
def subscriptions_list() -> None:
    """The subscriptions, their kind, what they read and handle."""
    from rich.table import Table

    from .subscriptions.api import Reactor

    settings = load_settings()
    table = Table("name", "kind", "reads", "handles")
    for subscription in configured_subscriptions(settings).values():
        handles = [t.__name__ for t in subscription.handlers]
        if isinstance(subscription, Reactor):
            handles += [f"outcome of {t.__name__}" for t in subscription.outcome_handlers]
        table.add_row(subscription.name, subscription.kind.value, ", ".join(a.name for a in subscription.reads), ", ".join(handles))
    print_table(table)


@subscriptions_cli.command("status")
def subscriptions_status(
    name: Annotated[str | None, typer.Argument(help="One subscription (default: all).")] = None,
) -> None:
    """Each subscription's lag per input partition, and whether it has caught up; exit 1 if one
    has not (or could not be read), else 2 if one holds parked events, which wait for an operator."""
    from rich.table import Table

    settings = load_settings()
    names = [name] if name is not None else list(configured_subscriptions(settings))
    behind, holding = [], []
    for each in names:
        try:
            status = asyncio.run(subscription_operations(settings, each).status())
        except _subscription_unavailable() as error:  # the others' status still tells
            err.print(f"[red]error:[/red] {each}: {escape(str(error))}", highlight=False, soft_wrap=True)
            behind.append(each)
            continue
        except AUTHORIZATION_REFUSED as error:
            err.print(f"[red]error:[/red] {each}: {escape(refused_by_authorizer(settings, error))}", highlight=False, soft_wrap=True)
            behind.append(each)
            continue
        except (KafkaError, TimeoutError) as error:  # a cluster without its quorum, say: asked for a minute
            err.print(f"[red]error:[/red] {each}: Kafka did not answer in time ({escape(repr(error))})", highlight=False, soft_wrap=True)
            behind.append(each)
            continue
        table = Table("topic", "partition", "next offset", "end", "lag", "parked", title=f"{status.name} ({status.kind})")
        for p in status.partitions:
            next_offset = "-" if p.next_offset is None else str(p.next_offset)
            table.add_row(p.topic, str(p.partition), next_offset, str(p.end), str(p.lag), str(p.parked))
        print_table(table)
        parked = f"; {status.parked:,} parked (esk subscriptions parked {status.name})" if status.parked else ""
        not_started = f"; {status.not_started}" if status.not_started else ""
        console.print(
            f"{status.name}: {'caught up' if status.caught_up else f'{status.lag:,} behind'}{parked}{not_started}", highlight=False
        )
        if not status.caught_up:
            behind.append(status.name)
        if status.parked:
            holding.append(status.name)
    if behind or holding:
        raise typer.Exit(code=1 if behind else 2)


@subscriptions_cli.command("parked")
def subscriptions_parked(
    name: NameArgument,
    include_resolved: Annotated[bool, typer.Option("--all", help="Retried and skipped ones too.")] = False,
    output: Annotated[Output, _output_option("an event")] = Output.TABLE,
) -> None:
    """The subscription's parked events, in order per aggregate, with the reason (and, for one
    a reset's replay parked again, how it was resolved before)."""
    from rich.table import Table

    found = _operate(name, lambda operations: operations.parked(include_resolved))
    parked = sorted(found, key=lambda e: (e.aggregate_id, e.topic, e.partition, e.offset))

    def told_earlier(event: ParkedEvent) -> str:
        return "; ".join(f"{r.status.value} by {r.by or '?'} at {_utc_ms(r.at)}" for r in event.earlier)

    if output != "table":  # every field, for a script (a JSON line's `earlier` a list)
        columns = ["aggregate_id", "event_type", "topic", "partition", "offset", "parked_at", "attempts", "reason",
                   "status", "resolved_by", "resolved_at", "earlier"]  # fmt: skip
        rows: list[list[Any]] = [
            [e.aggregate_id, e.event_type, e.topic, e.partition, e.offset, _utc_ms(e.parked_at), e.attempts, e.reason,
             e.status.value, e.resolved_by, None if e.resolved_at is None else _utc_ms(e.resolved_at),
             [{"status": r.status.value, "by": r.by, "at": _utc_ms(r.at), "reason": r.reason} for r in e.earlier]
             if output == "json" else told_earlier(e)]
            for e in parked
        ]  # fmt: skip
        print_rows(columns, rows, output)
        return
    earlier = any(event.earlier for event in parked)
    table = Table(
        "aggregate", "event", "position", "parked at", "attempts", "reason",
        *(("status", "by") if include_resolved else ()), *(("earlier",) if earlier else ()),
    )
    for event in parked:
        resolved = (event.status.value, event.resolved_by or "") if include_resolved else ()
        table.add_row(
            event.aggregate_id, event.event_type or "?", event.position, _utc_ms(event.parked_at), str(event.attempts),
            event.reason, *resolved, *((told_earlier(event),) if earlier else ()),
        )
    print_table(table)
    console.print(f"{name}: {sum(e.status == 'parked' for e in parked)} parked", highlight=False)


@subscriptions_cli.command("retry")
def subscriptions_retry(name: NameArgument, aggregate: AggregateOption = None, by: ByOption = None) -> None:
    """Handle the parked events again, in order per aggregate, with today's code and upcasters;
    exit 1 when some stay parked."""
    report = _operate(name, lambda operations: operations.retry(aggregate, by or _os_user()))
    _print_resolved(name, "retried", report)


@subscriptions_cli.command("skip")
def subscriptions_skip(name: NameArgument, aggregate: AggregateOption = None, by: ByOption = None) -> None:
    """Drop the event each aggregate's parked events wait behind (its handler failed, or it did
    not decode), and handle those again, in order; who skipped it and when is recorded."""
    report = _operate(name, lambda operations: operations.skip(aggregate, by or _os_user()))
    _print_resolved(name, "skipped", report)


def _utc_ms(ms: int | None) -> str:
    from datetime import UTC, datetime

    return "?" if ms is None else datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="seconds")


def _print_resolved(name: str, done: str, report: Any) -> None:
    for event in report.handled:
        console.print(f"{event.status} {event.aggregate_id} {event.event_type or '?'} at {event.position}", highlight=False)
    for event in report.still_parked:
        console.print(f"still parked {event.aggregate_id} {event.event_type or '?'} at {event.position}: {escape(event.reason)}", highlight=False, soft_wrap=True)
    counts = Counter(str(event.status) for event in report.handled) or Counter({done: 0})
    told = ", ".join(f"{n} {status}" for status, n in sorted(counts.items(), key=lambda item: item[0] != done))
    console.print(f"{name}: {told}, {len(report.still_parked)} still parked", highlight=False)
    if report.still_parked:
        raise typer.Exit(code=1)


def _os_user() -> str:
    import getpass

    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no name for the uid (a container)
        return "unknown"


@subscriptions_cli.command("reset")
def subscriptions_reset(
    name: NameArgument,
    to: Annotated[str, typer.Option("--to", help="earliest, or an ISO 8601 time (e.g. 2025-01-31T12:00:00+00:00).")],
    keep_data: Annotated[
        bool, typer.Option("--keep-data", help="A database handler: replay into its tables as they are (on_reset not run); needed for --to <time>.")
    ] = False,
    by: ByOption = None,
) -> None:
    """Replay: rewind the offsets (a database handler's on_reset hook runs in the same
    transaction); handlers see ctx.replaying until the subscription is back where it was.
    Events still parked past the new offsets are marked reset (recorded, as a skip is)."""
    from datetime import UTC, datetime

    if to == "earliest":
        when = None
    else:
        try:
            when = datetime.fromisoformat(to)
        except ValueError:
            raise fail(f"--to must be earliest or an ISO 8601 time, not {to!r}") from None
        if when.tzinfo is None:
            when = when.replace(tzinfo=UTC)
    offsets = _operate(name, lambda operations: operations.reset(when, keep_data, by or _os_user()))
    for tp, offset in sorted(offsets.items()):
        console.print(f"{tp.topic}/{tp.partition} -> {offset}", highlight=False)
    console.print(f"{name}: reset to {to}", highlight=False)


def _operate(name: str, operation: Callable[[Any], Coroutine[Any, Any, T]]) -> T:
    """`operation` on the subscription's SubscriptionOperations; what refuses it, or a
    database that does not answer, in a line."""
    from .subscriptions.operations import RefusedError

    settings = load_settings()
    try:
        with told_when_refused(settings):
            return asyncio.run(operation(subscription_operations(settings, name)))
    except RefusedError as error:
        raise fail(str(error)) from None
    except _subscription_unavailable() as error:
        raise fail(f"{name}: {error}") from None


def _subscription_unavailable() -> tuple[type[Exception], ...]:
    """What keeps a command-line tool from a subscription's stores, told in a line."""
    from .kafka.metadata import TopicMissing
    from .subscriptions.parking import WrittenByNewerRelease
    from .subscriptions.stores import DatabaseMissing, DatabaseUnreachable

    return DatabaseMissing, DatabaseUnreachable, TopicMissing, WrittenByNewerRelease


def print_rows(columns: list[str], rows: list[list[Any]], output: str) -> None:
    import csv

    import orjson
    from rich.table import Table

    if output == "csv":
        writer = csv.writer(sys.stdout)
        writer.writerow(columns)
        # booleans as JSON and SQL write them, not as Python does
        writer.writerows([[str(v).lower() if isinstance(v, bool) else v for v in row] for row in rows])
    elif output == "json":
        for row in rows:
            sys.stdout.write(orjson.dumps(dict(zip(columns, row, strict=True)), default=str).decode() + "\n")
    else:
        table = Table(*columns)
        for row in rows:
            table.add_row(*("" if v is None else str(v) for v in row))
        print_table(table)


def print_table(table: Table) -> None:
    # Piped or in a log, rich would cut the table to 80 columns (a grep would miss what was
    # cut): as wide as it needs then.
    (console if console.is_terminal else Console(width=10_000, emoji=False)).print(table)


def main() -> None:
    cli()


if __name__ == "__main__":
    main()
