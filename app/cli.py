"""The `esk` command line."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.console import Console

from app.broker import BrokerError, EmbeddedBroker
from app.kafka.topics import ensure_topics, topic_specs
from app.registry import load_registry
from app.settings import Settings

cli = typer.Typer(no_args_is_help=True, add_completion=False, help="esk: event sourcing and CQRS on Apache Kafka.")
broker_cli = typer.Typer(no_args_is_help=True, help="The embedded single-node Kafka broker (KRaft).")
topics_cli = typer.Typer(no_args_is_help=True, help="The application's topics.")
cli.add_typer(broker_cli, name="broker")
cli.add_typer(topics_cli, name="topics")

console = Console()
err = Console(stderr=True)


def load_settings(**overrides: Any) -> Settings:
    """ESK_* variables and .env first; flags that were given override them."""
    settings = Settings()
    for dotted, value in overrides.items():
        if value is None:
            continue
        section, _, name = dotted.partition("__")
        if name:
            part = getattr(settings, section).model_copy(update={name: value})
            settings = settings.model_copy(update={section: part})
        else:
            settings = settings.model_copy(update={section: value})
    logging.basicConfig(level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("aiokafka").setLevel(max(logging.WARNING, logging.getLogger().level))
    return settings


def fail(message: str) -> typer.Exit:
    err.print(f"[red]error:[/red] {message}", highlight=False)
    return typer.Exit(code=1)


PortOption = Annotated[Optional[int], typer.Option("--port", help="Broker port (ESK_BROKER__PORT).")]
DataDirOption = Annotated[Optional[Path], typer.Option("--data-dir", help="Broker data directory.")]


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
    partitions: Annotated[Optional[int], typer.Option(help="Partitions per topic (ESK_TOPICS__PARTITIONS).")] = None,
) -> None:
    """Create the application's topics, or check the ones that exist; exit 1 on any mismatch."""
    settings = load_settings(topics__partitions=partitions)
    init_topics(settings)


def init_topics(settings: Settings) -> None:
    registry = load_registry(settings.domain)
    report = asyncio.run(ensure_topics(settings, topic_specs(settings, registry)))
    for name in report.created:
        console.print(f"created  {name}")
    for name in report.ok:
        console.print(f"ok       {name}")
    for problem in report.problems:
        err.print(f"[red]problem[/red]  {problem}", highlight=False)
    if report.problems:
        raise fail("topics do not match the settings; fix them (or the settings) and run again")


@cli.command("processor")
def processor() -> None:
    """Run the processor (production entry point): one task per assigned commands partition."""
    from app.runtime import run_processor

    run_processor(load_settings())


@cli.command("api")
def api(
    host: Annotated[Optional[str], typer.Option(help="Listen address (ESK_API__HOST).")] = None,
    port: Annotated[Optional[int], typer.Option(help="Listen port (ESK_API__PORT).")] = None,
) -> None:
    """Run the HTTP API (production entry point)."""
    from app.runtime import run_api

    run_api(load_settings(api__host=host, api__port=port))


@cli.command("dev")
def dev() -> None:
    """Everything on one machine: embedded broker (unless ESK_KAFKA__BOOTSTRAP_SERVERS is set),
    topics, processor and API. Ctrl-C stops all of it."""
    from app.runtime import run_dev

    settings = load_settings()
    broker = EmbeddedBroker(settings.broker) if settings.uses_embedded_broker else None
    started_broker = False
    if broker is not None:
        try:
            started_broker = not broker.status().running
            console.print(f"broker {broker.start().describe()}")
        except BrokerError as error:
            raise fail(str(error)) from None
    try:
        init_topics(settings)
        console.print(
            f"API on http://{settings.api.host}:{settings.api.port} (docs: /docs); Ctrl-C stops everything",
            highlight=False,
        )
        run_dev(settings)
    finally:
        if broker is not None and started_broker:
            broker.stop()
            console.print("broker stopped")


def main() -> None:
    cli()


if __name__ == "__main__":
    main()
