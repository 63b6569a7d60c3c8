"""OpenTelemetry tracing: the trace context in Kafka record headers, and one trace from an
HTTP request through the processor, the example `payments` saga and the processor's
handling of the commands the saga sent, against the real broker.

The spans go to the SDK's in-memory exporter: the settings say `exporter="none"`, so esk
installs no provider of its own and uses the one this process has."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path

import httpx
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, TraceFlags, TraceState

from esk import tracing
from esk.settings import Settings, TracingSettings
from subscriptions import payments
from tests.subscriptions.running import subscriber, subscriber_settings
from tests.system import system, wait_for

TRACE_ID = 0x4BF92F3577B34DA6A3CE929D0E0E4736
SPAN_ID = 0x00F067AA0BA902B7


def remote(trace_id: int = TRACE_ID, span_id: int = SPAN_ID) -> SpanContext:
    return trace.get_current_span(tracing.context_of([("traceparent", traceparent(trace_id, span_id).encode())])).get_span_context()


def traceparent(trace_id: int, span_id: int) -> str:
    return f"00-{trace_id:032x}-{span_id:016x}-01"


# -- the headers, alone ------------------------------------------------------------------


def test_a_spans_context_goes_into_record_headers_and_comes_back_out() -> None:
    state = TraceState([("vendor", "opaque")])
    span = NonRecordingSpan(SpanContext(TRACE_ID, SPAN_ID, is_remote=False, trace_flags=TraceFlags(TraceFlags.SAMPLED), trace_state=state))
    headers = tracing.headers_for(span)
    assert headers == [
        ("traceparent", b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
        ("tracestate", b"vendor=opaque"),
    ]
    # among esk's own headers, as on an event record
    back = trace.get_current_span(tracing.context_of([("esk-event-type", b"Placed"), *headers])).get_span_context()
    assert (back.trace_id, back.span_id, back.is_remote, back.trace_flags.sampled) == (TRACE_ID, SPAN_ID, True, True)
    assert back.trace_state == state


def test_a_record_without_a_valid_trace_context_starts_none() -> None:
    for headers in (None, [], [("esk-event-type", b"Placed")], [("traceparent", b"00-not-a-trace-01")],
                    [("traceparent", traceparent(0, SPAN_ID).encode())]):
        assert not trace.get_current_span(tracing.context_of(headers)).get_span_context().is_valid, headers
    assert tracing.headers_for() == []  # no current span: nothing to carry


def test_an_http_requests_traceparent_is_read_from_its_asgi_headers() -> None:
    context = tracing.context_of_http([(b"content-type", b"application/json"), (b"traceparent", traceparent(TRACE_ID, SPAN_ID).encode())])
    assert trace.get_current_span(context).get_span_context() == remote()


def test_the_provider_follows_the_settings() -> None:
    assert tracing.tracer_provider(TracingSettings(), "esk-api") is None  # off by default
    assert tracing.tracer_provider(TracingSettings(enabled=True, exporter="none"), "esk-api") is None
    provider = tracing.tracer_provider(TracingSettings(enabled=True, exporter="console"), "esk-api")
    assert provider is not None and provider.resource.attributes["service.name"] == "esk-api"
    named = tracing.tracer_provider(TracingSettings(enabled=True, exporter="otlp", service_name="shop"), "esk-api")
    assert named is not None and named.resource.attributes["service.name"] == "shop"
    for made in (provider, named):
        made.shutdown()


# -- one trace, end to end -----------------------------------------------------------------

_EXPORTER = InMemorySpanExporter()


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    """The process's TracerProvider (set once per process: OpenTelemetry allows no other)
    with the in-memory exporter."""
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
        provider.add_span_processor(SimpleSpanProcessor(_EXPORTER))
    _EXPORTER.clear()
    yield _EXPORTER
    _EXPORTER.clear()


class Trace:
    def __init__(self, spans: tuple[ReadableSpan, ...], trace_id: int) -> None:
        self.spans = [s for s in spans if s.context is not None and s.context.trace_id == trace_id]

    def one(self, name: str, **attributes: object) -> ReadableSpan:
        found = [s for s in self.spans if s.name == name and all(s.attributes is not None and s.attributes.get(k) == v for k, v in attributes.items())]
        assert len(found) == 1, (name, attributes, [(s.name, s.attributes) for s in self.spans])
        return found[0]


def child_of(span: ReadableSpan, parent: ReadableSpan) -> bool:
    assert span.parent is not None and parent.context is not None, (span.name, parent.name)
    return bool(span.parent.span_id == parent.context.span_id)


HEAD_TRACE = 0x0123_4567_89AB_CDEF_0123_4567_89AB_CDEF


async def post(client: httpx.AsyncClient, path: str, body: Mapping[str, object], headers: dict[str, str] | None = None) -> None:
    r = await client.post(path, json=body, headers=headers)
    assert r.status_code == 200, r.text


@pytest.mark.kafka
async def test_one_trace_from_http_through_the_saga_to_its_commands(
    settings: Settings, tmp_path: Path, spans: InMemorySpanExporter
) -> None:
    settings = subscriber_settings(settings, tmp_path / "subscriptions")
    settings = settings.model_copy(update={"tracing": TracingSettings(enabled=True, exporter="none")})
    paid, refused = 0x1111_2222_3333_4444_5555_6666_7777_8888, 0x9999_AAAA_BBBB_CCCC_DDDD_EEEE_FFFF_0001
    async with system(settings) as running:
        client = running.client
        await post(client, "/v1/accounts/funded/open", {"owner": "ada"})  # no traceparent: a trace of its own
        await post(client, "/v1/accounts/funded/deposit", {"amount": 1000})
        await post(client, "/v1/accounts/empty/open", {"owner": "bob"})
        order = {"customer_id": "c1", "lines": [{"sku": "a", "qty": 3, "price": 100}]}
        await post(client, "/v1/orders/o-paid/place", order | {"pay_from": "funded"}, {"traceparent": traceparent(paid, SPAN_ID)})
        await post(client, "/v1/orders/o-refused/place", order | {"pay_from": "empty"}, {"traceparent": traceparent(refused, SPAN_ID)})

        async with subscriber(settings, payments, running.registry):
            await wait_for(lambda: _cancelled(client, "o-refused"), what="the refused order to be cancelled")
            # an accepted withdrawal's outcome changes nothing the API shows: only its span
            # tells that the saga has read it (its partition may come after the refused one's)
            await wait_for(lambda: _outcome_read(spans, paid), what="the saga to read the accepted withdrawal's outcome")
        # open, deposit, withdrawal: version 3, once the replica has the withdrawal
        assert (await client.get("/v1/accounts/funded", params={"min_version": 3})).json()["state"]["balance"] == 700
        # a HEAD is served as its GET, and its span is named by the GET's route all the same
        assert (await client.head("/v1/accounts/funded", headers={"traceparent": traceparent(HEAD_TRACE, SPAN_ID)})).status_code == 200

    finished = spans.get_finished_spans()
    Trace(finished, HEAD_TRACE).one("HEAD /v1/{type_name}/{id}", **{"http.route": "/v1/{type_name}/{id}", "http.response.status_code": 200})
    opened = Trace(finished, next(s.context.trace_id for s in finished if s.name == "POST /v1/accounts/{id}/open" and s.context))
    http = opened.one("POST /v1/accounts/{id}/open", **{"http.response.status_code": 200})
    assert http.parent is None and http.kind is SpanKind.SERVER
    assert child_of(opened.one("handle accounts.open", **{"esk.aggregate.id": "funded"}), opened.one("send accounts.open"))

    # HTTP -> the command record -> its handling -> the saga -> the withdrawal's handling
    chain = Trace(finished, paid)
    http = chain.one("POST /v1/orders/{id}/place", **{"http.route": "/v1/orders/{id}/place", "url.path": "/v1/orders/o-paid/place"})
    assert http.parent is not None and http.parent.span_id == SPAN_ID and http.parent.is_remote  # the caller's
    send = chain.one("send orders.place")
    assert child_of(send, http) and send.kind is SpanKind.PRODUCER
    place = chain.one("handle orders.place", **{"esk.aggregate.type": "orders", "esk.aggregate.id": "o-paid", "esk.command.outcome": "accepted"})
    assert child_of(place, send) and place.kind is SpanKind.CONSUMER
    assert place.attributes is not None and place.attributes["esk.command.id"]
    saga = chain.one("payments Placed", **{"esk.subscription": "payments", "esk.event.type": "Placed"})
    assert child_of(saga, place) and saga.attributes is not None
    assert saga.attributes["messaging.destination.name"] == f"{settings.app}.orders.events"
    assert isinstance(saga.attributes["messaging.kafka.offset"], int)
    withdraw = chain.one("handle accounts.withdraw", **{"esk.aggregate.id": "funded", "esk.command.outcome": "accepted"})
    assert child_of(withdraw, saga)
    # the saga reads the withdrawal's outcome too (and sends nothing when it was accepted)
    outcome = chain.one("payments outcome accounts.withdraw", **{"esk.command.outcome": "accepted"})
    assert child_of(outcome, withdraw)
    # one server span per request (FastAPI's own is off), and nothing else in the trace
    assert sorted(s.name for s in chain.spans) == sorted(s.name for s in (http, send, place, saga, withdraw, outcome))

    # ... and on through the refused withdrawal's outcome to the cancellation
    chain = Trace(finished, refused)
    saga = chain.one("payments Placed")
    withdraw = chain.one("handle accounts.withdraw", **{"esk.command.outcome": "rejected", "esk.command.code": "insufficient_funds"})
    assert child_of(saga, chain.one("handle orders.place", **{"esk.aggregate.id": "o-refused"})) and child_of(withdraw, saga)
    outcome = chain.one("payments outcome accounts.withdraw", **{"esk.command.outcome": "rejected"})
    assert child_of(outcome, withdraw)
    assert child_of(chain.one("handle orders.cancel", **{"esk.aggregate.id": "o-refused", "esk.command.outcome": "accepted"}), outcome)


def _outcome_read(spans: InMemorySpanExporter, trace_id: int) -> bool:
    return any(s.name == "payments outcome accounts.withdraw" and s.context is not None and s.context.trace_id == trace_id
               for s in spans.get_finished_spans())


async def _cancelled(client: httpx.AsyncClient, order_id: str) -> bool:
    return bool((await client.get(f"/v1/orders/{order_id}")).json()["state"]["status"] == "cancelled")
