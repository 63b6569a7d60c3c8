"""The AsyncAPI 3.0.0 document of an application's event topics: what a service that
subscribes to `<app>.<type>.events` reads (`esk schema asyncapi`, `GET /asyncapi.json`).

One channel per aggregate type, addressed by its events topic; one message per event type.
A message's payload is the whole record value as esk writes it, the `EventRecord` envelope
with `data` the event's current schema; its key is the aggregate id, its headers the esk-*
ones. The envelope and the headers are read off `EventRecord` itself, so the document
follows the record when its fields change. Given the project's lock file, each earlier
schema version it holds of an event is a message too (`Opened.v1`): records of it stay on
the topic for good, and a consumer that validates what it reads must take them.
"""

from __future__ import annotations

from importlib import metadata
from typing import Any

import msgspec

from ..domain.aggregate import AggregateType, Event
from ..domain.json_schema import model_schema
from ..kafka.topics import TopicNames, topic_specs
from ..protocol import EventRecord
from ..registry import Registry
from ..settings import Settings
from .lock import JsonSchema, Lock, LockedAggregate

ASYNCAPI_VERSION = "3.0.0"
KAFKA_BINDING_VERSION = "0.5.0"
_SCHEMAS = "#/components/schemas/"
# The envelope's fields that differ from message to message; the rest is EventRecord's own.
_DATA, _TYPE, _SCHEMA_VERSION = "data", "type", "schema_version"

# Kafka's security.protocol and sasl.mechanism, in AsyncAPI's terms.
_TLS_PROTOCOLS = frozenset({"SSL", "SASL_SSL"})
_SASL_SCHEMES = {"PLAIN": "plain", "SCRAM-SHA-256": "scramSha256", "SCRAM-SHA-512": "scramSha512", "GSSAPI": "gssapi"}

_READING = (
    "Read with isolation.level=read_committed: esk writes events in Kafka transactions, and "
    "only committed ones happened. An aggregate's events are in order on one partition, "
    "versions 1, 2, 3… without gap; `data` of an older `schema_version` is brought up to "
    "date by the aggregate type's upcasters (`AggregateType.decode_event`)."
)


def asyncapi_document(settings: Settings, registry: Registry, lock: Lock | None = None) -> dict[str, Any]:
    """The AsyncAPI document of the events topics of `registry`'s aggregate types, with the
    earlier schema versions of their events that `lock` holds."""
    schemas: dict[str, Any] = {}
    envelope = _envelope(schemas)
    channels: dict[str, Any] = {}
    operations: dict[str, Any] = {}
    topics = TopicNames(settings.app)
    for aggregate in registry.values():
        locked = lock.aggregates.get(aggregate.name) if lock is not None else None
        messages: dict[str, Any] = {}
        for event in aggregate.events:
            name = event.type_name()
            messages[name] = _message(aggregate.name, name, event.schema_version, _data_schema(aggregate, event, schemas), envelope)
            for version, schema in _earlier_versions(locked, event):
                data = _locked_data_schema(f"{aggregate.name}.{name}.v{version}", schema, schemas)
                messages[f"{name}.v{version}"] = _message(aggregate.name, name, version, data, envelope, current=False)
        channels[aggregate.name] = {
            "address": topics.events(aggregate.name),
            "title": f"{aggregate.name} events",
            "description": f"Every event of every {aggregate.name} aggregate, keyed by the aggregate id; kept forever.",
            "messages": messages,
            "bindings": {"kafka": _topic_binding(settings, aggregate.name)},
        }
        operations[f"{aggregate.name}.receive"] = {
            "action": "receive",
            "channel": {"$ref": f"#/channels/{aggregate.name}"},
            "messages": [{"$ref": f"#/channels/{aggregate.name}/messages/{name}"} for name in messages],
            "summary": f"Services subscribe to the {aggregate.name} events.",
            "description": _READING,
        }
    servers, security_schemes = _servers(settings)
    components: dict[str, Any] = {"schemas": schemas}
    if security_schemes:
        components["securitySchemes"] = security_schemes
    return {
        "asyncapi": ASYNCAPI_VERSION,
        "id": f"urn:esk:{settings.app}",
        "info": {
            "title": f"{settings.app} events",
            "version": _esk_version(),
            "description": f"The event topics of the esk application `{settings.app}`: one channel per aggregate type.",
        },
        "defaultContentType": "application/json",
        "servers": servers,
        "channels": channels,
        "operations": operations,
        "components": components,
    }


def _esk_version() -> str:
    try:
        return metadata.version("esk")
    except metadata.PackageNotFoundError:  # a source tree on the path, never installed
        return "0.0.0"


def _envelope(schemas: dict[str, Any]) -> dict[str, Any]:
    """EventRecord's JSON schema, from its declared fields and their types (msgspec reads
    a Struct or a dataclass alike); any type it refers to goes into `schemas`."""
    name = EventRecord.__name__
    _, components = msgspec.json.schema_components([EventRecord], ref_template=f"{_SCHEMAS}esk.{{name}}")
    envelope: dict[str, Any] = components.pop(name)
    schemas.update({f"esk.{other}": schema for other, schema in components.items()})
    missing = {_DATA, _TYPE, _SCHEMA_VERSION} - envelope["properties"].keys()
    if missing:
        raise TypeError(f"{name} has no field {sorted(missing)}: the AsyncAPI document describes them per event type")
    return envelope


def _message(
    aggregate: str, name: str, version: int, data: dict[str, Any], envelope: dict[str, Any], current: bool = True
) -> dict[str, Any]:
    title = name if current else f"{name}.v{version}"
    payload = {
        **envelope,
        "title": f"{aggregate} {title} record",
        "properties": {
            **envelope["properties"],
            _TYPE: {"type": "string", "const": name},
            _SCHEMA_VERSION: {"type": "integer", "const": version},
            _DATA: data,
        },
    }
    earlier = "" if current else ", an earlier one: its records stay on the topic, and the upcasters bring them up to date"
    return {
        "name": title,
        "title": title,
        "summary": f"{aggregate} {name} (schema version {version}{earlier})",
        "contentType": "application/json",
        "headers": _headers(envelope, name, version),
        "payload": payload,
        "bindings": {
            "kafka": {
                "key": {"type": "string", "description": "The aggregate id (UTF-8), as in the record's aggregate_id."},
                "bindingVersion": KAFKA_BINDING_VERSION,
            }
        },
    }


def _data_schema(aggregate: AggregateType[Any], event: type[Event], schemas: dict[str, Any]) -> dict[str, Any]:
    """A reference to the event's current schema, put into `schemas` under a name of its
    aggregate type's, with the models it refers to beside it (two aggregate types may
    well have events, or nested models, of the same name)."""
    name = f"{aggregate.name}.{event.type_name()}"
    schema = model_schema(event, ref_template=f"{_SCHEMAS}{name}.{{model}}")
    for model, definition in schema.pop("$defs", {}).items():
        schemas[f"{name}.{model}"] = definition
    schemas[name] = schema
    return {"$ref": _SCHEMAS + name}


def _earlier_versions(locked: LockedAggregate | None, event: type[Event]) -> list[tuple[int, JsonSchema]]:
    """The schemas of `event`'s versions before its current one that the lock holds, oldest
    first (a lock not written since the version was raised holds the last one as its own)."""
    found = locked.events.get(event.type_name()) if locked is not None else None
    return [] if found is None else list(found.before(event.schema_version).items())


def _locked_data_schema(name: str, schema: JsonSchema, schemas: dict[str, Any]) -> dict[str, Any]:
    """A reference to a locked schema, put into `schemas` under `name`, with the models it
    refers to beside it, its references to them pointed there."""
    prefix = "#/$defs/"

    def moved(node: Any) -> Any:
        if isinstance(node, dict):
            return {
                key: f"{_SCHEMAS}{name}.{value.removeprefix(prefix)}" if key == "$ref" and isinstance(value, str) and value.startswith(prefix)
                else moved(value)
                for key, value in node.items()
            }
        if isinstance(node, list):
            return [moved(item) for item in node]
        return node

    schema = dict(schema)
    for model, definition in schema.pop("$defs", {}).items():
        schemas[f"{name}.{model}"] = moved(definition)
    schemas[name] = moved(schema)
    return {"$ref": _SCHEMAS + name}


def _headers(envelope: dict[str, Any], name: str, version: int) -> dict[str, Any]:
    """The headers EventRecord.headers() writes for the records of event type `name` at
    schema `version`. Two records that differ in every other field tell the headers apart:
    those that agree depend on the event type alone (its name, its version) and are given
    as constants."""
    fixed = {_TYPE: name, _SCHEMA_VERSION: version}
    one, two = (
        dict(msgspec.convert({**_sample(envelope, seed), **fixed}, EventRecord).headers()) for seed in (1, 2)
    )
    properties = {
        header: {"type": "string", **({"const": value.decode()} if two[header] == value else {})}
        for header, value in one.items()
    }
    return {"type": "object", "properties": properties, "required": list(properties)}


def _sample(envelope: dict[str, Any], seed: int) -> dict[str, Any]:
    """A record value whose every field is `seed` in its field's JSON type (an optional
    field's first alternative)."""
    by_type: dict[str, Any] = {"string": str(seed), "integer": seed, "number": seed, "boolean": seed % 2 == 0, "object": {}, "array": []}
    return {field: by_type[schema.get("anyOf", [schema])[0]["type"]] for field, schema in envelope["properties"].items()}


def _topic_binding(settings: Settings, aggregate_type: str) -> dict[str, Any]:
    """The events topic as `esk topics init` creates it."""
    topic = TopicNames(settings.app).events(aggregate_type)
    (spec,) = (spec for spec in topic_specs(settings, [aggregate_type]) if spec.name == topic)
    return {
        "partitions": spec.partitions,
        "replicas": spec.replication_factor,
        "topicConfiguration": {
            "cleanup.policy": spec.configs["cleanup.policy"].split(","),
            "retention.ms": int(spec.configs["retention.ms"]),
        },
        "bindingVersion": KAFKA_BINDING_VERSION,
    }


def _servers(settings: Settings) -> tuple[dict[str, Any], dict[str, Any]]:
    """One server per bootstrap address, and the security schemes they use."""
    kafka = settings.kafka
    schemes: dict[str, Any] = {}
    mechanism = kafka.sasl_mechanism or "PLAIN"  # the clients' when none is set
    sasl = _SASL_SCHEMES.get(mechanism.upper()) if kafka.security_protocol.startswith("SASL_") else None
    if sasl is not None:
        schemes["sasl"] = {"type": sasl, "description": f"SASL {mechanism}"}
    if kafka.security_protocol == "SSL" and kafka.ssl_certfile is not None:
        schemes["tls-client-certificate"] = {"type": "X509", "description": "TLS with a client certificate"}
    server: dict[str, Any] = {
        "protocol": "kafka-secure" if kafka.security_protocol in _TLS_PROTOCOLS else "kafka",
        "description": f"Kafka, security.protocol {kafka.security_protocol}",
    }
    if schemes:
        server["security"] = [{"$ref": f"#/components/securitySchemes/{scheme}"} for scheme in schemes]
    addresses = [address.strip() for address in settings.bootstrap_servers.split(",") if address.strip()]
    return {f"kafka-{number}": {"host": address, **server} for number, address in enumerate(addresses, 1)}, schemes
