"""The AsyncAPI document of the event topics: checked by the AsyncAPI parser itself (npm
@asyncapi/parser, installed by `make tools-node`), which must also refuse broken copies of
it; and compared with the records the processor writes."""

from __future__ import annotations

import copy
import functools
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from esk.processing.command_handler import handle_command
from esk.protocol import CommandEnvelope
from esk.registry import Registry, load_registry
from esk.schema.asyncapi import asyncapi_document
from esk.schema.lock import read_lock
from esk.settings import Settings

VALIDATOR = Path(__file__).resolve().parents[2] / "tools" / "asyncapi" / "validate.cjs"
NODE = shutil.which("node")
needs_node = pytest.mark.skipif(NODE is None, reason="node is not installed (apt-get install nodejs npm): the AsyncAPI validator runs on it")


def settings(**kafka: Any) -> Settings:
    return Settings(app="shop", kafka={"bootstrap_servers": "k1:9092,k2:9092", **kafka}, _env_file=None)


@pytest.fixture(scope="module")
def registry() -> Registry:
    return load_registry("domain:AGGREGATES")


@pytest.fixture(scope="module")
def document(registry: Registry) -> dict[str, Any]:
    return asyncapi_document(settings(), registry)


@pytest.fixture(scope="module")
def with_lock(registry: Registry) -> dict[str, Any]:
    """With the example's committed lock file, which holds Opened's and Placed's v1."""
    return asyncapi_document(settings(), registry, read_lock(Path(__file__).resolve().parents[2] / "esk.lock.json"))


def validate(tmp_path: Path, documents: dict[str, dict[str, Any]]) -> tuple[int, dict[str, list[str]]]:
    """The validator's exit code, and its diagnostics of each document by severity."""
    paths = {name: tmp_path / f"{name}.json" for name in documents}
    for name, document in documents.items():
        paths[name].write_text(json.dumps(document))
    assert NODE is not None
    result = subprocess.run([NODE, str(VALIDATOR), *map(str, paths.values())], capture_output=True, text=True, timeout=120)
    assert result.returncode in (0, 1), f"the validator could not run: {result.stderr}"  # 2: not installed, or crashed
    lines = result.stdout.splitlines()
    diagnostics = {name: [line for line in lines if line.startswith(f"{path}: ")] for name, path in paths.items()}
    return result.returncode, diagnostics


def severities(diagnostics: list[str]) -> set[str]:
    return {line.split(": ", 2)[1].split()[0] for line in diagnostics}


def resolve(document: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    pointer = schema["$ref"].removeprefix("#/").split("/")
    return functools.reduce(lambda node, part: node[part], pointer, document)


@needs_node
def test_the_document_is_valid_asyncapi(tmp_path: Path, document: dict[str, Any], with_lock: dict[str, Any], registry: Registry) -> None:
    documents = {
        "plaintext": document,
        "with_earlier_versions": with_lock,
        "sasl_ssl": asyncapi_document(settings(security_protocol="SASL_SSL", sasl_mechanism="SCRAM-SHA-512"), registry),
        "mutual_tls": asyncapi_document(settings(security_protocol="SSL", ssl_certfile="client.pem"), registry),
    }
    code, diagnostics = validate(tmp_path, documents)
    assert code == 0, diagnostics
    # Only the reminder that AsyncAPI 3.1.0 exists: no error, no warning.
    assert all(severities(found) <= {"info"} for found in diagnostics.values()), diagnostics
    assert documents["sasl_ssl"]["servers"]["kafka-1"]["protocol"] == "kafka-secure"
    assert documents["sasl_ssl"]["components"]["securitySchemes"]["sasl"]["type"] == "scramSha512"
    # no mechanism set: the clients' PLAIN
    unset = asyncapi_document(settings(security_protocol="SASL_PLAINTEXT"), registry)["components"]["securitySchemes"]["sasl"]
    assert unset == {"type": "plain", "description": "SASL PLAIN"}
    assert documents["mutual_tls"]["components"]["securitySchemes"]["tls-client-certificate"]["type"] == "X509"


@needs_node
def test_the_validator_refuses_broken_documents(tmp_path: Path, document: dict[str, Any]) -> None:
    """The negative control: proof that the validator really reads the documents."""
    dangling, unversioned, unpartitioned = (copy.deepcopy(document) for _ in range(3))
    dangling["operations"]["accounts.receive"]["messages"][0] = {"$ref": "#/channels/accounts/messages/Nowhere"}
    del unversioned["info"]["version"]
    unpartitioned["channels"]["orders"]["bindings"]["kafka"]["partitions"] = 0  # the Kafka binding says at least 1
    code, diagnostics = validate(tmp_path, {"dangling": dangling, "unversioned": unversioned, "unpartitioned": unpartitioned})
    assert code == 1
    expected = {
        "dangling": "error invalid-ref at /operations/accounts.receive/messages/0/$ref",
        "unversioned": 'required property "version"',
        "unpartitioned": "error asyncapi-document-resolved at /channels/orders/bindings/kafka/partitions",
    }
    assert all(any(expected[name] in line for line in diagnostics[name]) for name in expected), diagnostics


def test_a_channel_per_events_topic_and_a_message_per_event_type(document: dict[str, Any], registry: Registry) -> None:
    assert set(document["channels"]) == set(registry)
    for name, aggregate in registry.items():
        channel = document["channels"][name]
        assert channel["address"] == f"shop.{name}.events"
        assert list(channel["messages"]) == [event.type_name() for event in aggregate.events]
        operation = document["operations"][f"{name}.receive"]
        assert operation["action"] == "receive" and operation["channel"] == {"$ref": f"#/channels/{name}"}
    assert [server["host"] for server in document["servers"].values()] == ["k1:9092", "k2:9092"]


def test_a_message_is_the_current_version_of_its_event(document: dict[str, Any]) -> None:
    opened = document["channels"]["accounts"]["messages"]["Opened"]
    properties = opened["payload"]["properties"]
    assert properties["type"]["const"] == "Opened"
    assert properties["schema_version"]["const"] == 2
    assert "owner" in resolve(document, properties["data"])["required"]
    assert opened["headers"]["properties"]["esk-event-type"] == {"type": "string", "const": "Opened"}
    assert opened["headers"]["properties"]["esk-schema-version"] == {"type": "string", "const": "2"}
    assert opened["bindings"]["kafka"]["key"]["type"] == "string"
    # A nested model lives beside its event's schema in the components, referred to there.
    placed = resolve(document, document["channels"]["orders"]["messages"]["Placed"]["payload"]["properties"]["data"])
    assert resolve(document, placed["properties"]["lines"]["items"])["title"] == "Line"


def test_an_earlier_schema_version_the_lock_holds_is_a_message_of_its_own(document: dict[str, Any], with_lock: dict[str, Any]) -> None:
    messages = with_lock["channels"]["accounts"]["messages"]
    assert set(messages) == {*document["channels"]["accounts"]["messages"], "Opened.v1"}
    assert {"$ref": "#/channels/accounts/messages/Opened.v1"} in with_lock["operations"]["accounts.receive"]["messages"]
    # a record an earlier release wrote (v1 said "name") is what its message says
    written = {
        "event_id": "accounts/legacy/1", "aggregate_type": "accounts", "aggregate_id": "legacy", "version": 1,
        "type": "Opened", "schema_version": 1, "data": {"name": "old-timer"}, "command_id": "x",
        "correlation_id": "x", "causation_id": "x", "recorded_at": 1_700_000_000_000,
    }
    old = messages["Opened.v1"]
    assert set(written) == set(old["payload"]["properties"]) == set(old["payload"]["required"])
    assert all(written[name] == field["const"] for name, field in old["payload"]["properties"].items() if "const" in field)
    assert resolve(with_lock, old["payload"]["properties"]["data"])["required"] == ["name"]
    assert old["headers"]["properties"]["esk-schema-version"] == {"type": "string", "const": "1"}
    # the models a locked schema refers to are beside it, its references pointed there
    placed = resolve(with_lock, with_lock["channels"]["orders"]["messages"]["Placed.v1"]["payload"]["properties"]["data"])
    assert resolve(with_lock, placed["properties"]["lines"]["items"])["title"] == "Line"
    assert "#/$defs/" not in json.dumps(with_lock)
    assert "Opened.v1" not in document["channels"]["accounts"]["messages"]  # without the lock: the current versions


@pytest.mark.parametrize(
    ("aggregate", "command", "payload"),
    [("accounts", "open", {"owner": "ann"}), ("orders", "place", {"customer_id": "c-1", "lines": [{"sku": "s", "qty": 1, "price": 5}]})],
)
def test_a_record_the_processor_writes_is_what_its_message_says(
    document: dict[str, Any], registry: Registry, aggregate: str, command: str, payload: dict[str, Any]
) -> None:
    envelope = CommandEnvelope(command_id="cmd-1", aggregate_type=aggregate, aggregate_id="id-1", command=command, payload=payload)
    (record,) = handle_command(registry[aggregate], envelope, None, now=1).events
    message = document["channels"][aggregate]["messages"][record.type]
    value, headers = json.loads(record.encode()), {name: raw.decode() for name, raw in record.headers()}
    for written, schema in ((value, message["payload"]), (headers, message["headers"])):
        assert set(written) == set(schema["properties"]) == set(schema["required"])
        assert all(written[name] == field["const"] for name, field in schema["properties"].items() if "const" in field)
    data = resolve(document, message["payload"]["properties"]["data"])
    assert set(data["required"]) <= set(value["data"]) <= set(data["properties"])
