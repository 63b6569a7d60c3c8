"""esk against a broker that speaks only TLS + SASL/SCRAM to its clients and allows only
what ACLs allow, configured by settings alone: with the ACLs `esk topics acls` prints, the
topics, the processor and the HTTP API, subscribers and Spark's Kafka source work; a wrong
password, an untrusted certificate or a missing ACL stops each process at start with one
line that says why, not a hang or a retry loop."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import sqlite3
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from aiokafka import AIOKafkaProducer
from typer.testing import CliRunner

from esk.broker import EmbeddedBroker
from esk.cli import cli, init_topics
from esk.kafka.acls import PrefixedAcl
from esk.kafka.client_options import client_options, not_trusted
from esk.kafka.topics import TopicNames, coordinators_ready, ensure_topics, topic_specs
from esk.protocol import EventRecord
from esk.registry import load_registry
from esk.settings import Settings
from subscriptions.customer_ledger import customer_ledger
from subscriptions.payments import payments
from tests.security.conftest import (
    CLIENT_KEY_PASSWORD,
    READER,
    READER_PASSWORD,
    Certificates,
    grant,
    kafka_acls,
    kafka_security,
    secured_settings_of,
)
from tests.subscriptions.running import subscriber
from tests.system import processor, system, wait_for

pytestmark = pytest.mark.kafka

START_FAILS_WITHIN_S = 30.0


async def test_commands_and_subscribers_over_tls_and_scram(secured_settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    """With only the ACLs `esk topics acls` prints: a database handler, and a reactor (its
    commands and offsets in transactions, the outcomes it reads, its parked topic made)."""
    async with system(secured_settings) as s:  # topics created, processor and API started
        c = s.client
        assert (await c.post("/v1/accounts/a1/open", json={"owner": "ada"})).status_code == 200
        assert (await c.post("/v1/accounts/a1/deposit", json={"amount": 40})).status_code == 200
        assert (await c.get("/v1/accounts/a1")).json()["state"]["balance"] == 40
        for order, price in (("o1", 5), ("o2", 7)):
            placed = await c.post(f"/v1/orders/{order}/place", json={"customer_id": "c1", "lines": [{"sku": "a", "qty": 2, "price": price}]})
            assert placed.status_code == 200
        for order, account in (("o3", "a1"), ("o4", "nobody")):  # paid by the reactor, or cancelled by it
            body = {"customer_id": "c2", "lines": [{"sku": "a", "qty": 1, "price": 10}], "pay_from": account}
            assert (await c.post(f"/v1/orders/{order}/place", json=body)).status_code == 200

        async with subscriber(secured_settings, customer_ledger, s.registry) as ledger, subscriber(secured_settings, payments, s.registry):
            await ledger.caught_up()
            await wait_for(lambda: _state_is(c, "accounts/a1", "balance", 30), 60, "o3 paid from a1")
            await wait_for(lambda: _state_is(c, "orders/o4", "status", "cancelled"), 60, "o4 cancelled")
        for name, value in security_environment(secured_settings).items():
            monkeypatch.setenv(name, value)
        monkeypatch.setenv("ESK_TOPICS__PARTITIONS", str(secured_settings.topics.partitions))
        monkeypatch.setenv("ESK_SUBSCRIBER__DATA_DIR", str(secured_settings.subscriber.data_dir))
        status = await asyncio.to_thread(CliRunner().invoke, cli, ["subscriptions", "status", "payments"])
        assert status.exit_code == 0, status.output
    database = Path(secured_settings.subscriber.data_dir) / "customer_ledger.sqlite"
    with contextlib.closing(sqlite3.connect(database)) as db:
        assert db.execute("SELECT customer_id, orders, total FROM customer_ledger WHERE customer_id = 'c1'").fetchall() == [("c1", 2, 24)]


async def _state_is(client: httpx.AsyncClient, aggregate: str, field: str, value: object) -> bool:
    answer = await client.get(f"/v1/{aggregate}")
    return answer.status_code == 200 and answer.json()["state"].get(field) == value


@pytest.mark.spark
def test_spark_reads_the_secured_topics(secured_settings: Settings) -> None:
    """Through the Kafka source options every projection's stream gets (a batch read: a
    projection's run on top, Delta and all, would cost a minute on a small machine)."""
    pytest.importorskip("pyspark")
    from esk.projections.events import decode, kafka_source_options
    from esk.projections.session import spark_session

    asyncio.run(write_account_events(secured_settings))
    spark = spark_session(secured_settings, "esk-security-tests")
    try:
        raw = (
            spark.read.format("kafka")
            .options(**kafka_source_options(secured_settings))
            .option("subscribe", TopicNames(secured_settings.app).events("accounts"))
            .load()
        )
        rows = decode(raw).select("aggregate_id", "version", "type").orderBy("version").collect()
    finally:
        spark.stop()
    assert [tuple(row) for row in rows] == [("a1", 1, "Opened"), ("a1", 2, "Deposited"), ("a1", 3, "Withdrawn")]


async def write_account_events(settings: Settings) -> None:
    """Three events of account a1, written by a plain producer (over SASL_SSL too)."""
    await ensure_topics(settings, topic_specs(settings, load_registry(settings.domain)))
    events = [("Opened", 2, {"owner": "ada"}), ("Deposited", 1, {"amount": 50}), ("Withdrawn", 1, {"amount": 20})]
    producer = AIOKafkaProducer(**client_options(settings), acks="all")
    await producer.start()
    try:
        for version, (kind, schema_version, data) in enumerate(events, start=1):
            record = EventRecord(f"accounts/a1/{version}", "accounts", "a1", version, kind, schema_version, data, "c", "c", "c", 0)
            await producer.send_and_wait(TopicNames(settings.app).events("accounts"), record.encode(), key=b"a1", headers=record.headers())
    finally:
        await producer.stop()


def security_environment(settings: Settings) -> dict[str, str]:
    """The ESK_KAFKA__* variables of `settings`, as a user would export them."""
    kafka = settings.kafka
    return {
        "ESK_APP": settings.app,
        "ESK_KAFKA__BOOTSTRAP_SERVERS": settings.bootstrap_servers,
        "ESK_KAFKA__SECURITY_PROTOCOL": kafka.security_protocol,
        "ESK_KAFKA__SSL_CAFILE": str(kafka.ssl_cafile),
        "ESK_KAFKA__SSL_CERTFILE": str(kafka.ssl_certfile),
        "ESK_KAFKA__SSL_KEYFILE": str(kafka.ssl_keyfile),
        "ESK_KAFKA__SSL_PASSWORD": str(kafka.ssl_password),
        "ESK_KAFKA__SASL_MECHANISM": str(kafka.sasl_mechanism),
        "ESK_KAFKA__SASL_PLAIN_USERNAME": str(kafka.sasl_plain_username),
        "ESK_KAFKA__SASL_PLAIN_PASSWORD": str(kafka.sasl_plain_password),
    }


def test_a_wrong_password_stops_each_process_at_start_with_one_line(
    secured_broker: EmbeddedBroker, certificates: Certificates, tmp_path: Path
) -> None:
    wrong = Settings(app="wrong-password", kafka=kafka_security(secured_broker, certificates, sasl_plain_password="wrong"), _env_file=None)
    commands = {"processor": ["processor"], "api": ["api"], "subscriber": ["subscriber", "customer_ledger"]}
    for name, line in one_line_exits(wrong, tmp_path, commands).items():
        assert line.startswith("error: Kafka at ") and "refused SASL authentication as 'esk-app' (SCRAM-SHA-512)" in line, (name, line)
        assert "invalid credentials" in line and "ESK_KAFKA__SASL_PLAIN_PASSWORD" in line, (name, line)


def test_tls_without_sasl_to_a_sasl_listener_stops_each_process_at_start_with_one_line(
    secured_broker: EmbeddedBroker, certificates: Certificates, tmp_path: Path
) -> None:
    """The listener answers the connection's first request (ApiVersions, asked before any
    SASL handshake) and hangs up at the next: the processes waited for ever."""
    tls_only = Settings(app="tls-only", kafka=kafka_security(secured_broker, certificates, security_protocol="SSL"), _env_file=None)
    commands = {"processor": ["processor"], "api": ["api"], "subscriber": ["subscriber", "customer_ledger"], "topics": ["topics", "init"]}
    for name, line in one_line_exits(tls_only, tmp_path, commands).items():
        assert line == (
            f"error: Kafka at {secured_broker.bootstrap} closed the connection at esk's first request: does its listener ask for "
            "SASL? ESK_KAFKA__SECURITY_PROTOCOL=SSL leaves it out (SASL_SSL with ESK_KAFKA__SASL_MECHANISM, "
            "ESK_KAFKA__SASL_PLAIN_USERNAME and ESK_KAFKA__SASL_PLAIN_PASSWORD)"
        ), (name, line)


def test_a_missing_acl_stops_each_process_with_one_line(secured_broker: EmbeddedBroker, certificates: Certificates, tmp_path: Path) -> None:
    """The authorizer refuses a principal what no ACL allows: each process says so in a
    line that names what was refused and the command that prints esk's ACLs, at once,
    rather than a traceback, a retry loop or a wait for topics it cannot see."""
    settings = secured_settings_of(secured_broker, certificates, tmp_path)
    hint = f"`esk topics acls --principal User:esk-app` prints the ACLs app '{settings.app}' needs"

    nothing_granted = one_line_exits(
        settings,
        tmp_path,
        {"topics init": ["topics", "init"], "api": ["api"], "processor": ["processor"], "read model": ["project", "run", "customer_recent_orders"]},
    )
    assert nothing_granted["topics init"].endswith(f"refused user 'esk-app': TOPIC_AUTHORIZATION_FAILED (creating {settings.app}.commands); {hint}")
    for name in ("api", "processor", "read model"):  # which of the topics it asks about first is theirs to choose
        assert nothing_granted[name].startswith(f"error: Kafka at {settings.bootstrap_servers} refused user 'esk-app': TOPIC_AUTHORIZATION_FAILED (describing {settings.app}."), name
        assert nothing_granted[name].endswith(hint), name

    # A user that may read the topics and write none: the API's producer may not start.
    reader = settings.model_copy(update={"kafka": settings.kafka.model_copy(update={"sasl_plain_username": READER, "sasl_plain_password": READER_PASSWORD})})
    read_only = PrefixedAcl("topic", f"{settings.app}.", ("Describe", "Read"), "")
    kafka_acls(certificates, [read_only.kafka_acls_command(settings.bootstrap_servers, f"User:{READER}")])
    api = subprocess.run(
        [sys.executable, "-m", "esk", "api"], env=esk_environment(reader, tmp_path), capture_output=True, text=True, timeout=START_FAILS_WITHIN_S
    )
    assert api.returncode == 1 and "Traceback" not in api.stderr, api.stderr
    assert api.stderr.splitlines()[-1].endswith(
        f"refused user '{READER}': CLUSTER_AUTHORIZATION_FAILED; `esk topics acls --principal User:{READER}` prints the ACLs app '{settings.app}' needs"
    ), api.stderr

    # The topics and the groups, not the transactional ids: the topics are made, the
    # processor joins its group and is given partitions, and each task's producer refused.
    grant(secured_broker, certificates, settings, only=("topic", "group"))
    init_topics(settings)  # and the group coordinator made ready, which a new broker's first group waits for
    no_transactions = one_line_exits(settings, tmp_path, {"processor": ["processor"], "reactor": ["subscriber", "payments"]})
    assert re.fullmatch(
        rf"error: Kafka at \S+ refused user 'esk-app': TRANSACTIONAL_ID_AUTHORIZATION_FAILED \({settings.app}\.processor\.\d\); {re.escape(hint)}",
        no_transactions["processor"],
    ), no_transactions["processor"]
    assert re.fullmatch(
        rf"error: Kafka at \S+ refused user 'esk-app': TRANSACTIONAL_ID_AUTHORIZATION_FAILED "
        rf"\({settings.app}\.subscription\.payments\.{settings.app}\.\S+\.\d\); {re.escape(hint)}",
        no_transactions["reactor"],
    ), no_transactions["reactor"]


def esk_environment(settings: Settings, tmp_path: Path) -> dict[str, str]:
    """The environment of an `esk` process over `settings`' broker and app, its state in `tmp_path`."""
    return {
        **os.environ,
        **security_environment(settings),
        "ESK_PROCESSOR__STATE_DIR": str(tmp_path / "processor"),
        "ESK_PROCESSOR__METRICS_PORT": "0",
        "ESK_API__STATE_DIR": str(tmp_path / "api"),
        "ESK_API__PORT": "0",
        "ESK_SUBSCRIBER__DATA_DIR": str(tmp_path / "subscriptions"),
        "ESK_SUBSCRIBER__METRICS_PORT": "0",
        "ESK_PROJECTIONS__WAREHOUSE_DIR": str(tmp_path / "warehouse"),
        "ESK_TOPICS__PARTITIONS": str(settings.topics.partitions),
        "COLUMNS": "250",
    }


def one_line_exits(settings: Settings, tmp_path: Path, commands: dict[str, list[str]]) -> dict[str, str]:
    """Run each `esk` command of `commands` in a process of its own, with `settings`' Kafka
    variables; each must exit 1 within START_FAILS_WITHIN_S, with one line on stderr (no
    traceback, no retry messages): those lines, by name."""
    env = esk_environment(settings, tmp_path)
    started = time.monotonic()
    running = {
        name: subprocess.Popen([sys.executable, "-m", "esk", *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for name, args in commands.items()
    }
    try:
        outcomes = {name: process.communicate(timeout=START_FAILS_WITHIN_S) for name, process in running.items()}
    finally:
        for process in running.values():
            if process.poll() is None:
                process.kill()
                process.wait()
    assert time.monotonic() - started < START_FAILS_WITHIN_S
    lines = {}
    for name, (_, stderr) in outcomes.items():
        assert running[name].returncode == 1, (name, stderr)
        told = [line for line in stderr.splitlines() if " INFO " not in line]
        assert len(told) == 1, (name, stderr)
        lines[name] = told[0]
    return lines


def test_an_untrusted_certificate_stops_topics_init_with_one_line(
    secured_settings: Settings, certificates: Certificates, monkeypatch: pytest.MonkeyPatch
) -> None:
    environment = security_environment(secured_settings) | {"ESK_KAFKA__SSL_CAFILE": str(certificates.stranger_ca)}
    assert topics_init_error(monkeypatch, environment) == (
        f"error: Kafka at {secured_settings.bootstrap_servers}: its TLS certificate is not trusted (self-signed certificate); "
        "ESK_KAFKA__SSL_CAFILE names the CA certificates to trust (PEM)"
    )


@pytest.mark.parametrize(
    ("code", "why", "advice"),
    [
        (10, "certificate has expired", "the broker needs a certificate renewed (or esk's clock is wrong): no setting of esk's mends it"),
        (62, "Hostname mismatch, certificate is not valid for 'vm'.",
         "ESK_KAFKA__BOOTSTRAP_SERVERS names the brokers as their certificates do not: name them as they do "
         "(ESK_KAFKA__SSL_CHECK_HOSTNAME=false skips the host name check)"),
        (19, "self-signed certificate in certificate chain", "ESK_KAFKA__SSL_CAFILE names the CA certificates to trust (PEM)"),
    ],
    ids=["expired", "host name", "another CA"],
)  # fmt: skip
def test_a_certificate_not_trusted_is_told_with_what_mends_it(code: int, why: str, advice: str) -> None:
    """An expired broker certificate was told to be mended by esk's CA file."""
    error = ssl.SSLCertVerificationError(1, "certificate verify failed")
    error.verify_code, error.verify_message = code, why
    assert not_trusted("Kafka at k1:9093", error) == f"Kafka at k1:9093: its TLS certificate is not trusted ({why}); {advice}"


def topics_init_error(monkeypatch: pytest.MonkeyPatch, environment: dict[str, str]) -> str:
    """What `esk topics init` says, in `environment`, as it exits 1."""
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("COLUMNS", "250")
    result = CliRunner().invoke(cli, ["topics", "init"])
    assert result.exit_code == 1, result.output
    return result.output.strip()


def test_esk_topics_acls_prints_a_kafka_acls_command_per_resource_type(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ESK_APP", "shop")
    monkeypatch.setenv("ESK_KAFKA__BOOTSTRAP_SERVERS", "k1:9093,k2:9093")
    monkeypatch.setenv("COLUMNS", "80")  # the lines are not wrapped
    result = CliRunner().invoke(cli, ["topics", "acls", "--principal", "User:shop-svc"])
    assert result.exit_code == 0, result.output
    start = "kafka-acls.sh --bootstrap-server k1:9093,k2:9093 --add --allow-principal User:shop-svc"
    assert result.output.splitlines() == [
        "# `esk topics init` makes and checks the topics; the processes read and write them",
        f"{start} --operation Create --operation Describe --operation DescribeConfigs --operation Read --operation Write "
        "--topic shop. --resource-pattern-type prefixed",
        "# the processor's and each subscription's consumer group, and their committed offsets",
        f"{start} --operation Describe --operation Read --group shop. --resource-pattern-type prefixed",
        "# the processor's tasks and each reactor's partitions write in transactions",
        f"{start} --operation Describe --operation Write --transactional-id shop. --resource-pattern-type prefixed",
    ]


async def test_a_processor_group_named_otherwise_runs_with_the_acls_printed_for_it(
    secured_broker: EmbeddedBroker, certificates: Certificates, tmp_path: Path
) -> None:
    settings = secured_settings_of(secured_broker, certificates, tmp_path)
    settings = settings.model_copy(update={"processor": settings.processor.model_copy(update={"group_id": f"team-{settings.app}"})})
    await asyncio.to_thread(grant, secured_broker, certificates, settings)
    registry = load_registry(settings.domain)
    assert not (await ensure_topics(settings, topic_specs(settings, registry))).problems
    assert await coordinators_ready(settings) is None  # what `esk topics init` asks, as it warns otherwise
    async with processor(settings, registry):  # ready: in its group, every task's transactional id started
        pass


def test_a_processor_group_named_otherwise_gets_acls_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """ESK_PROCESSOR__GROUP_ID outside `<app>.`: its group, and its tasks' transactional ids
    (`<group>.<partition>`), are not under the app's prefix."""
    monkeypatch.setenv("ESK_APP", "shop")
    monkeypatch.setenv("ESK_PROCESSOR__GROUP_ID", "payments-team-processor")
    result = CliRunner().invoke(cli, ["topics", "acls", "--principal", "User:shop-svc"])
    assert result.exit_code == 0, result.output
    lines = [line for line in result.output.splitlines() if not line.startswith("# ")]
    assert len(lines) == 5 and all("--resource-pattern-type prefixed" in line for line in lines)
    assert "--operation Describe --operation Read --group payments-team-processor --resource" in lines[3]
    assert "--operation Describe --operation Write --transactional-id payments-team-processor. --resource" in lines[4]
    monkeypatch.setenv("ESK_PROCESSOR__GROUP_ID", "shop.processors")  # under the prefix: nothing more
    assert len(CliRunner().invoke(cli, ["topics", "acls", "--principal", "User:shop-svc"]).output.splitlines()) == 2 * 3


def test_no_client_certificate_stops_topics_init_with_one_line(secured_settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    """The listener asks for a client certificate (mutual TLS): a client without one is told so."""
    certificate = ("ESK_KAFKA__SSL_CERTFILE", "ESK_KAFKA__SSL_KEYFILE", "ESK_KAFKA__SSL_PASSWORD")
    environment = {name: value for name, value in security_environment(secured_settings).items() if name not in certificate}
    assert topics_init_error(monkeypatch, environment) == (
        f"error: Kafka at {secured_settings.bootstrap_servers} refused esk's TLS client certificate (SSLV3_ALERT_BAD_CERTIFICATE): "
        "it asks for one; ESK_KAFKA__SSL_CERTFILE and ESK_KAFKA__SSL_KEYFILE name it (ESK_KAFKA__SSL_PASSWORD an encrypted key's password)"
    )


@pytest.mark.parametrize(
    ("given", "told"),
    [
        ({"ESK_KAFKA__SASL_MECHANISM": "SCRAM-SHA-512", "ESK_KAFKA__SASL_PLAIN_USERNAME": "esk"},
         "SASL_SSL with SCRAM-SHA-512 needs ESK_KAFKA__SASL_PLAIN_PASSWORD, not set"),
        ({}, "SASL_SSL with PLAIN needs ESK_KAFKA__SASL_PLAIN_USERNAME and ESK_KAFKA__SASL_PLAIN_PASSWORD, not set"),
    ],
    ids=["no password", "neither"],
)  # fmt: skip
def test_sasl_without_its_credentials_stops_topics_init_with_one_line(monkeypatch: pytest.MonkeyPatch, given: dict[str, str], told: str) -> None:
    """Before any connection (aiokafka's clients failed on them with a traceback); a document
    of the topics (`esk schema asyncapi`) needs none."""
    for name in ("ESK_KAFKA__SASL_PLAIN_USERNAME", "ESK_KAFKA__SASL_PLAIN_PASSWORD", "ESK_KAFKA__SASL_MECHANISM"):
        monkeypatch.delenv(name, raising=False)
    environment = {"ESK_KAFKA__BOOTSTRAP_SERVERS": "127.0.0.1:9", "ESK_KAFKA__SECURITY_PROTOCOL": "SASL_SSL", **given}
    assert topics_init_error(monkeypatch, environment) == f"error: ESK_KAFKA__SECURITY_PROTOCOL={told}"


def test_a_wrong_key_password_or_a_missing_file_stops_topics_init_with_one_line(
    certificates: Certificates, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Read before any connection: no broker is needed to tell them."""
    environment = {
        "ESK_KAFKA__BOOTSTRAP_SERVERS": "127.0.0.1:9",
        "ESK_KAFKA__SECURITY_PROTOCOL": "SSL",
        "ESK_KAFKA__SSL_CAFILE": str(certificates.ca),
        "ESK_KAFKA__SSL_CERTFILE": str(certificates.client_certificate),
        "ESK_KAFKA__SSL_KEYFILE": str(certificates.client_key),
        "ESK_KAFKA__SSL_PASSWORD": "not the password",
    }
    check = "check ESK_KAFKA__SSL_CAFILE, ESK_KAFKA__SSL_CERTFILE, ESK_KAFKA__SSL_KEYFILE and ESK_KAFKA__SSL_PASSWORD (an encrypted key's password)"
    assert topics_init_error(monkeypatch, environment) == (
        "error: esk's TLS files could not be read (the client certificate and key do not load: a wrong password, "
        f"or a key not the certificate's): {check}"
    )
    missing = environment | {"ESK_KAFKA__SSL_PASSWORD": CLIENT_KEY_PASSWORD, "ESK_KAFKA__SSL_CAFILE": str(tmp_path / "missing.crt")}
    assert topics_init_error(monkeypatch, missing) == f"error: esk's TLS files could not be read (No such file or directory): {check}"
    # an encrypted key and no password: OpenSSL asked for it on the terminal, twice
    unset = {k: v for k, v in {**os.environ, **environment}.items() if k != "ESK_KAFKA__SSL_PASSWORD"}
    told = subprocess.run(
        [sys.executable, "-m", "esk", "topics", "init"], env=unset, cwd=Path(__file__).resolve().parents[2],
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert told.returncode == 1 and "pass phrase" not in told.stdout + told.stderr, told.stderr
    assert told.stderr.strip().endswith(check), told.stderr
