"""Runs real esk components inside the test's event loop: processors and API servers
(uvicorn on a free port), against the suite's real broker."""

from __future__ import annotations

import asyncio
import inspect
import os
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
import uvicorn
from aiokafka import AIOKafkaConsumer
from aiokafka.structs import ConsumerRecord
from fastapi import FastAPI

from esk.api.http import create_app, server_options
from esk.broker.ports import free_port
from esk.kafka.client_options import client_options
from esk.kafka.reader import read_committed
from esk.kafka.topics import TopicNames, ensure_topics, topic_specs
from esk.processing.processor import Processor
from esk.protocol import CommandEnvelope
from esk.registry import Registry, load_registry
from esk.settings import Settings


async def wait_for(predicate: Any, timeout_s: float = 60.0, what: str = "condition") -> None:
    """Poll `predicate` (a function returning a bool, or an awaitable of one) until it holds."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await _holds(predicate()):
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


async def _holds(result: Any) -> bool:
    return bool(await result) if inspect.isawaitable(result) else bool(result)


@dataclass
class RunningProcessor:
    processor: Processor
    stop: asyncio.Event
    task: asyncio.Task[None]

    async def shutdown(self) -> None:
        self.stop.set()
        await asyncio.wait_for(self.task, 60)


@asynccontextmanager
async def processor(settings: Settings, registry: Registry, wait_ready: bool = True) -> AsyncIterator[RunningProcessor]:
    proc = Processor(settings, registry)
    stop = asyncio.Event()
    running = RunningProcessor(proc, stop, asyncio.create_task(proc.run(stop)))
    try:
        if wait_ready:
            await wait_for(lambda: proc.ready or running.task.done(), what="processor ready")
            if running.task.done():
                running.task.result()
        yield running
    finally:
        if not running.task.done():
            await running.shutdown()


@asynccontextmanager
async def api(settings: Settings, registry: Registry) -> AsyncIterator[httpx.AsyncClient]:
    async with api_app(settings, registry) as (_app, client):
        yield client


@asynccontextmanager
async def api_app(settings: Settings, registry: Registry) -> AsyncIterator[tuple[FastAPI, httpx.AsyncClient]]:
    """An API server, and its app (`app.state` holds its replica and history index)."""
    port = free_port()
    app = create_app(settings, registry)
    options = server_options(settings) | {"host": "127.0.0.1", "port": port, "log_level": "warning"}
    server = uvicorn.Server(uvicorn.Config(app, lifespan="on", **options))
    serving = asyncio.create_task(server.serve())
    try:
        await wait_for(lambda: server.started or serving.done(), what="API started")
        if serving.done():
            serving.result()
        await wait_for(app.state.replica.ready.is_set, what="API replica ready")
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            yield app, client
    finally:
        server.should_exit = True
        await asyncio.wait_for(serving, 30)


@dataclass
class System:
    settings: Settings
    registry: Registry
    clients: list[httpx.AsyncClient] = field(default_factory=list)
    apps: list[FastAPI] = field(default_factory=list)
    processors: list[RunningProcessor] = field(default_factory=list)

    @property
    def client(self) -> httpx.AsyncClient:
        return self.clients[0]


@asynccontextmanager
async def system(settings: Settings, apis: int = 1, processors: int = 1) -> AsyncIterator[System]:
    registry = load_registry(settings.domain)
    report = await ensure_topics(settings, topic_specs(settings, registry))
    assert not report.problems, report.problems
    running = System(settings, registry)
    async with AsyncExitStack() as stack:
        for n in range(processors):
            own = with_state_dirs(settings, f"p{n}")
            running.processors.append(await stack.enter_async_context(processor(own, registry)))
        for n in range(apis):
            own = with_state_dirs(settings, f"a{n}")
            app, client = await stack.enter_async_context(api_app(own, registry))
            running.apps.append(app)
            running.clients.append(client)
        yield running


async def processors_domain(settings: Settings, **processor: Any) -> tuple[Settings, Registry]:
    """`settings` with these processor settings, and its domain with its topics made: for
    tests that run several processors over them."""
    settings = settings.model_copy(update={"processor": settings.processor.model_copy(update=processor)})
    registry = load_registry(settings.domain)
    await ensure_topics(settings, topic_specs(settings, registry))
    return settings, registry


@asynccontextmanager
async def first_processor(
    settings: Settings, registry: Registry, accounts: int
) -> AsyncIterator[tuple[httpx.AsyncClient, RunningProcessor, list[str]]]:
    """An API and a first processor (state directories "a0" and "p0"), which owns every
    partition as it opens `accounts` new accounts: for more processors to join."""
    opened = [f"a{n}-{uuid.uuid4().hex[:6]}" for n in range(accounts)]
    async with api(with_state_dirs(settings, "a0"), registry) as client, processor(with_state_dirs(settings, "p0"), registry) as first:
        for account in opened:
            assert (await client.post(f"/v1/accounts/{account}/open", json={"owner": "o"})).status_code == 200
        yield client, first, opened


def sharing(first: RunningProcessor, second: RunningProcessor, partitions: set[int]) -> bool:
    """Both processors ready, each with partitions of its own, all of them between them."""
    owned = set(first.processor.tasks), set(second.processor.tasks)
    return first.processor.ready and second.processor.ready and all(owned) and owned[0] | owned[1] == partitions


def with_state_dirs(settings: Settings, suffix: str) -> Settings:
    """Each instance gets its own state directory, as each would on its own host."""
    processor_dir = Path(settings.processor.state_dir) / suffix
    api_dir = Path(settings.api.state_dir) / suffix
    return settings.model_copy(
        update={
            "processor": settings.processor.model_copy(update={"state_dir": processor_dir}),
            "api": settings.api.model_copy(update={"state_dir": api_dir}),
        }
    )


def command_record(topic: str, offset: int, envelope: CommandEnvelope, partition: int = 0) -> ConsumerRecord[bytes, bytes]:
    """The record a processor would have fetched for `envelope` at `offset`."""
    return ConsumerRecord(
        topic=topic, partition=partition, offset=offset, timestamp=0, timestamp_type=0, key=envelope.key,
        value=envelope.encode(), checksum=None, serialized_key_size=0, serialized_value_size=0, headers=[],
    )


@asynccontextmanager
async def task_builders(settings: Settings, registry: Registry, *names: str) -> AsyncIterator[list[Processor]]:
    """Processors that are not running, one per name (own state directories), each with a
    consumer in the group but no subscription: for building partitions by hand
    (`task_manager.build`) and driving their tasks record by record."""
    processors = [Processor(with_state_dirs(settings, name), registry) for name in names]
    consumers = [AIOKafkaConsumer(**client_options(settings), group_id=p.group_id, enable_auto_commit=False) for p in processors]
    try:
        for processor, consumer in zip(processors, consumers, strict=True):
            processor.task_manager.consumer = consumer
            await consumer.start()
        yield processors
    finally:
        for consumer in consumers:
            await consumer.stop()


async def read_topic(settings: Settings, topic: str, decode: bool = True) -> list[Any]:
    """Every committed record of a topic, as (key, JSON-decoded value, headers)."""
    return [
        (r.key, orjson.loads(r.value) if decode and r.value else r.value, dict(r.headers))
        for r in await read_committed(settings, topic)
    ]


def events_topic(settings: Settings, aggregate_type: str) -> str:
    return TopicNames(settings.app).events(aggregate_type)


REPO = Path(__file__).resolve().parents[1]


def esk_env(settings: Settings, **more: str) -> dict[str, str]:
    """The environment of an `esk` command run as its own process with `settings` (the
    caller's own ESK_* variables left out), its domain and read models found in this
    repository."""
    return {k: v for k, v in os.environ.items() if not k.startswith("ESK_")} | {
        "ESK_APP": settings.app,
        "ESK_KAFKA__BOOTSTRAP_SERVERS": settings.bootstrap_servers,
        "ESK_TOPICS__PARTITIONS": str(settings.topics.partitions),
        "ESK_DOMAIN": settings.domain,
        "ESK_READ_MODELS": settings.read_models,
        "ESK_PROJECTIONS__WAREHOUSE_DIR": str(settings.projections.warehouse_dir),
        "PYTHONPATH": str(REPO),
        **more,
    }


@asynccontextmanager
async def esk_process(args: list[str], env: dict[str, str], log: Path) -> AsyncIterator[asyncio.subprocess.Process]:
    """`esk *args` as its own process, its output in `log`; killed at the block's end if it
    still runs then."""
    with log.open("wb") as out:
        process = await asyncio.create_subprocess_exec(sys.executable, "-m", "esk", *args, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield process
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
