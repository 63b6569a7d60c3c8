"""OpenTelemetry tracing: one trace from an HTTP request through the command's handling, the
events it wrote, the subscribers that handled them and the commands those sent.

The W3C trace context (`traceparent`, `tracestate`) travels in Kafka record headers: on a
command record (from the API, or from a reactor), and on the events and the outcome that
the command's handling wrote. Each process starts its span as a child of the context of the
record it handles.

Off by default. Each component reads `settings.tracing.enabled` once, when it is made, and
while it is off makes no span and adds no header. `setup` installs the process's
TracerProvider from the settings: `otlp` (OTLP over HTTP, `pip install 'esk[otlp]'`),
`console` (every span on stdout), or `none`: esk installs no provider, and spans go to the
one the process has (set by the application, by `opentelemetry-instrument`, or by a test),
or nowhere, while the context still passes through unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.propagators.textmap import Getter, Setter
from opentelemetry.trace import Span
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from .protocol import CommandEnvelope
from .settings import Settings, TracingSettings

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

# Kafka record headers as aiokafka hands them over and takes them.
RecordHeaders = Sequence[tuple[str, bytes]]

# Resolved through the global provider on first use, so it may be taken before `setup` runs.
TRACER = trace.get_tracer("esk")

_PROPAGATOR = TraceContextTextMapPropagator()
_FIELDS = frozenset(_PROPAGATOR.fields)
_FIELDS_BYTES = frozenset(name.encode() for name in _FIELDS)


class _RecordHeaderGetter(Getter[RecordHeaders]):
    def get(self, carrier: RecordHeaders, key: str) -> list[str] | None:
        # A header value is bytes; the trace context's fields are ASCII by definition.
        values = [value.decode("latin-1") for name, value in carrier if name == key]
        return values or None

    def keys(self, carrier: RecordHeaders) -> list[str]:
        return [name for name, _ in carrier]


class _RecordHeaderSetter(Setter[list[tuple[str, bytes]]]):
    def set(self, carrier: list[tuple[str, bytes]], key: str, value: str) -> None:
        carrier.append((key, value.encode("latin-1")))


_GETTER = _RecordHeaderGetter()
_SETTER = _RecordHeaderSetter()


def context_of(headers: RecordHeaders | None) -> Context:
    """The trace context a Kafka record carries; an empty one (a new trace) when none."""
    return _PROPAGATOR.extract(headers or (), getter=_GETTER)


def context_of_http(headers: Iterable[tuple[bytes, bytes]]) -> Context:
    """The trace context of an HTTP request, from its ASGI headers (lower-case names)."""
    fields = {name.decode("latin-1"): value.decode("latin-1") for name, value in headers if name in _FIELDS_BYTES}
    return _PROPAGATOR.extract(fields)


def headers_for(span: Span | None = None) -> list[tuple[str, bytes]]:
    """Kafka record headers that carry `span`'s context (the current span's when None) to
    whoever handles the record; empty when there is no valid span."""
    headers: list[tuple[str, bytes]] = []
    context = trace.set_span_in_context(span) if span is not None else None
    _PROPAGATOR.inject(headers, context=context, setter=_SETTER)
    return headers


def command_attributes(envelope: CommandEnvelope, topic: str) -> dict[str, str]:
    """What a span about one command record says of it."""
    return {
        "messaging.system": "kafka",
        "messaging.destination.name": topic,
        "esk.command": f"{envelope.aggregate_type}.{envelope.command}",
        "esk.command.id": envelope.command_id,
        "esk.aggregate.type": envelope.aggregate_type,
        "esk.aggregate.id": envelope.aggregate_id,
    }


def tracer_provider(tracing: TracingSettings, service_name: str) -> TracerProvider | None:
    """The provider the settings ask for; None when esk is to install none. The SDK is
    imported only here, so a process with tracing off never loads it."""
    if not tracing.enabled or tracing.exporter == "none":
        return None
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    exporter: SpanExporter
    if tracing.exporter == "console":
        exporter = ConsoleSpanExporter()
    else:
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError as error:
            raise RuntimeError("ESK_TRACING__EXPORTER=otlp needs the OTLP exporter: pip install 'esk[otlp]'") from error
        # No endpoint: the exporter's own defaults (OTEL_EXPORTER_OTLP_* variables, else localhost:4318).
        exporter = OTLPSpanExporter(endpoint=tracing.endpoint)
    provider = TracerProvider(
        resource=Resource.create({"service.name": tracing.service_name or service_name}),
        # A trace that arrives (HTTP, record headers) keeps its sampling decision; the ratio
        # applies to the traces that start here.
        sampler=ParentBased(TraceIdRatioBased(tracing.sample_ratio)),
    )
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def setup(settings: Settings, process: str) -> None:
    """Install the process's TracerProvider (service `<app>-<process>` unless the settings
    name one). Spans still buffered are exported when the process exits."""
    provider = tracer_provider(settings.tracing, f"{settings.app}-{process}")
    if provider is not None:
        trace.set_tracer_provider(provider)
