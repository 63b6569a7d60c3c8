"""Every status code and header of the HTTP contract, against the real broker and processor."""

from __future__ import annotations

import asyncio
import logging
import uuid

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from esk.api.gateway import CommandGateway
from esk.kafka.partitioner import partition_for
from esk.kafka.reader import read_committed
from esk.kafka.topics import TopicNames
from esk.protocol import CommandEnvelope, payload_digest
from esk.registry import load_registry
from esk.settings import Settings
from tests.system import events_topic, processor, read_topic, system, wait_for

pytestmark = pytest.mark.kafka
PROBLEM = "application/problem+json"


def new_id() -> str:
    return uuid.uuid4().hex[:12]


async def open_account(client: httpx.AsyncClient, account: str, deposit: int = 0) -> None:
    r = await client.post(f"/v1/accounts/{account}/open", json={"owner": "ada"}, headers={"If-None-Match": "*"})
    assert r.status_code == 200, r.text
    if deposit:
        r = await client.post(f"/v1/accounts/{account}/deposit", json={"amount": deposit})
        assert r.status_code == 200, r.text


async def test_the_newcomer_walkthrough(settings: Settings) -> None:
    async with system(settings) as s:
        c, account = s.client, new_id()
        r = await c.post(f"/v1/accounts/{account}/open", json={"owner": "ada"}, headers={"If-None-Match": "*"})
        assert r.status_code == 200
        assert r.headers["etag"] == '"1"'
        body = r.json()
        assert body["version"] == 1 and body["type"] == "accounts" and body["id"] == account
        assert [(e["type"], e["version"], e["data"]) for e in body["events"]] == [("Opened", 1, {"owner": "ada"})]

        r = await c.post(f"/v1/accounts/{account}/deposit", json={"amount": 100}, headers={"If-Match": '"1"'})
        assert r.status_code == 200 and r.headers["etag"] == '"2"'

        r = await c.post(f"/v1/accounts/{account}/withdraw", json={"amount": 500})
        assert r.status_code == 422
        assert r.headers["content-type"] == PROBLEM
        assert r.json()["code"] == "insufficient_funds" and "100" in r.json()["detail"]

        r = await c.post(f"/v1/accounts/{account}/withdraw", json={"amount": 5}, headers={"If-Match": '"1"'})
        assert r.status_code == 412
        assert r.headers["etag"] == '"2"'
        assert r.json()["current_version"] == 2 and r.headers["content-type"] == PROBLEM

        r = await c.get(f"/v1/accounts/{account}")
        assert r.status_code == 200 and r.headers["etag"] == '"2"'
        assert r.json()["state"] == {"owner": "ada", "movements": 1, "balance": 100, "status": "open"}

        events = [v for k, v, _ in await read_topic(settings, events_topic(settings, "accounts")) if k == account.encode()]
        assert [(e["type"], e["version"]) for e in events] == [("Opened", 1), ("Deposited", 2)]


async def test_an_accepted_answer_tells_where_its_events_are(settings: Settings) -> None:
    """Read-your-writes: every event of the command lies below the answer's position, on the
    aggregate's events partition; a retry answers with a position too."""
    async with system(settings) as s:
        account = new_id()
        await open_account(s.client, account)
        r = await s.client.post(f"/v1/accounts/{account}/deposit", json={"amount": 7}, headers={"Idempotency-Key": f"d-{account}"})
        assert r.status_code == 200, r.text
        position = r.json()["position"]
        assert position["topic"] == events_topic(settings, "accounts") and r.headers["esk-position"] == position["token"]
        mine = [rec for rec in await read_committed(settings, position["topic"]) if rec.key == account.encode()]
        assert len(mine) == 2 and {rec.partition for rec in mine} == {position["partition"]}
        assert max(rec.offset for rec in mine) < position["offset"]

        again = await s.client.post(f"/v1/accounts/{account}/deposit", json={"amount": 7}, headers={"Idempotency-Key": f"d-{account}"})
        assert again.json()["version"] == 2 and again.json()["position"]["offset"] >= position["offset"]

        r = await s.client.post(f"/v1/accounts/{account}/withdraw", json={"amount": 500})
        assert r.status_code == 422 and "position" not in r.json() and "esk-position" not in r.headers


async def test_creating_twice(settings: Settings) -> None:
    async with system(settings) as s:
        c, account = s.client, new_id()
        await open_account(c, account)
        r = await c.post(f"/v1/accounts/{account}/open", json={"owner": "x"}, headers={"If-None-Match": "*"})
        assert r.status_code == 412 and r.json()["current_version"] == 1 and r.headers["etag"] == '"1"'
        r = await c.post(f"/v1/accounts/{account}/open", json={"owner": "x"})
        assert r.status_code == 409 and r.json()["code"] == "already_exists"
        assert r.json()["detail"] == f"accounts {account!r} already exists"


async def test_a_command_taken_by_another_api_instance_is_waited_for_with_wait_ms(settings: Settings) -> None:
    """Another instance took the command (its gateway put it on the commands topic): this
    one knows of it only once its outcome is in, so a read of it waits with `wait_ms`, where
    one without answers 404 at once, whatever is on its way."""
    async with system(settings) as s:
        other = CommandGateway(settings)
        await other.start()
        try:
            account = new_id()
            await other.submit(CommandEnvelope(f"elsewhere-{account}", "accounts", account, "open", {"owner": "ada"}))
        finally:
            await other.stop()
        r = await s.client.get(f"/v1/commands/elsewhere-{account}", params={"wait_ms": 30_000}, timeout=40)
        assert r.status_code == 200 and r.json()["http_status"] == 200 and r.json()["aggregate_id"] == account, r.text
        r = await s.client.get("/v1/commands/never-sent", params={"wait_ms": 300})
        assert r.status_code == 404 and r.json()["code"] == "unknown_command_id" and "wait_ms waits for it" in r.json()["detail"]
        r = await s.client.get("/v1/commands/never-sent", params={"wait_ms": -1})
        assert r.status_code == 400 and r.json()["code"] == "invalid_wait"


async def test_not_found_and_unknown_names(settings: Settings) -> None:
    async with system(settings) as s:
        c = s.client
        missing = new_id()
        r = await c.post(f"/v1/accounts/{missing}/deposit", json={"amount": 1})
        assert r.status_code == 404 and r.json()["code"] == "not_found"
        assert r.json()["detail"] == f"accounts {missing!r} does not exist"
        r = await c.post("/v1/planets/p1/open", json={})
        assert r.status_code == 404 and r.json()["code"] == "unknown_aggregate_type"
        r = await c.post("/v1/accounts/a1/transfer", json={})
        assert r.status_code == 404 and r.json()["code"] == "unknown_command"
        assert r.json()["detail"] == "accounts has no command 'transfer'; its commands: close, deposit, open, withdraw"
        assert r.headers["content-type"] == PROBLEM
        r = await c.get(f"/v1/accounts/{new_id()}")
        assert r.status_code == 404 and r.json()["code"] == "not_found"
        r = await c.get("/v1/planets/p1")
        assert r.status_code == 404 and r.json()["code"] == "unknown_aggregate_type"
        r = await c.get("/v1/commands/never-sent")
        assert r.status_code == 404 and r.json()["code"] == "unknown_command_id"
        r = await c.get("/v1/commands/z%0A%C2%88%09")  # control characters in the id (schemathesis found it)
        assert r.status_code == 404 and r.json()["code"] == "unknown_command_id"
        r = await c.get("/nowhere")
        assert r.status_code == 404 and r.headers["content-type"] == PROBLEM
        # Command paths are matched as Starlette's router matches them: decoded, one segment per id.
        spaced = f"a {new_id()}"
        r = await c.post(f"/v1/accounts/{spaced.replace(' ', '%20')}/open", json={"owner": "ada"})
        assert r.status_code == 200 and r.json()["id"] == spaced
        r = await c.post("/v1/accounts/a%2Fb/open", json={"owner": "ada"})
        assert r.status_code == 404 and r.headers["content-type"] == PROBLEM
        r = await c.get("/v1/accounts/a1/open")
        assert r.status_code == 405 and r.json()["code"] == "method_not_allowed"


async def test_bad_input_never_reaches_the_commands_topic(settings: Settings) -> None:
    async with system(settings) as s:
        c, account = s.client, new_id()
        url = f"/v1/accounts/{account}/deposit"
        json_header = {"Content-Type": "application/json"}
        r = await c.post(url, content=b'{"amount": ', headers=json_header)
        assert r.status_code == 400 and r.json()["code"] == "malformed_json"
        r = await c.post(url, json={"amount": "lots"})
        assert r.status_code == 422 and r.json()["code"] == "invalid_payload"
        assert r.json()["errors"][0]["loc"] == ["amount"]
        r = await c.post(url, json={"amount": 5, "note": "hi"})
        assert r.status_code == 422 and r.json()["errors"][0]["type"] == "extra_forbidden"
        r = await c.post(url, json=[1, 2])
        assert r.status_code == 422
        r = await c.post(url, content=b'{"amount": 5}', headers={"Content-Type": "text/plain"})
        assert r.status_code == 415
        # JSON is UTF-8, uncompressed here: a body said otherwise would be read as what it is not
        for headers in ({"Content-Type": "application/json; charset=latin-1"}, {**json_header, "Content-Encoding": "gzip"}):
            r = await c.post(url, content=b'{"amount": 5}', headers=headers)
            assert r.status_code == 415 and r.json()["code"] == "unsupported_media_type", headers
        r = await c.post(url, content=b'{"amount": 5, "pad": "' + b"x" * 70_000 + b'"}', headers=json_header)
        assert r.status_code == 413 and r.json()["code"] == "body_too_large"

        async def chunked() -> object:
            for _ in range(100):
                yield b"x" * 1000

        r = await c.post(url, content=chunked(), headers=json_header)
        assert r.status_code == 413
        r = await c.post(url, json={"amount": 5}, headers={"If-Match": "five"})
        assert r.status_code == 400 and r.json()["code"] == "invalid_if_match"
        r = await c.post(url, json={"amount": 5}, headers={"Idempotency-Key": "k" * 300})
        assert r.status_code == 400
        r = await c.get(f"/v1/accounts/{account}?min_version=abc")
        assert r.status_code == 422 and r.headers["content-type"] == PROBLEM

        commands = await read_topic(settings, TopicNames(settings.app).commands)
        assert commands == []


async def test_a_retried_idempotency_key_returns_the_original_and_emits_nothing_and_another_command_s_is_refused(settings: Settings) -> None:
    async with system(settings) as s:
        c, account = s.client, new_id()
        await open_account(c, account)
        key = {"Idempotency-Key": f"dep-{account}"}
        first = await c.post(f"/v1/accounts/{account}/deposit", json={"amount": 10}, headers=key)
        # Retries concurrently and afterwards, through the processor and from the replica.
        retries = await asyncio.gather(
            *(c.post(f"/v1/accounts/{account}/deposit", json={"amount": 10}, headers=key) for _ in range(5))
        )
        assert first.status_code == 200
        # the same amount written another way is the same payload
        as_written = await c.post(f"/v1/accounts/{account}/deposit", content=b'{"amount": 1.0e1}', headers={**key, "Content-Type": "application/json"})
        for retry in [*retries, as_written]:
            assert retry.status_code == 200 and retry.json() == first.json()
        # The key again, for another command, aggregate or payload: refused, not answered
        # with the deposit's outcome
        other = new_id()
        await open_account(c, other)
        for url, body in (
            (f"/v1/accounts/{account}/withdraw", {"amount": 20}),
            (f"/v1/accounts/{other}/deposit", {"amount": 20}),
            (f"/v1/accounts/{account}/deposit", {"amount": 20}),
        ):
            reused = await c.post(url, json=body, headers=key)
            assert reused.status_code == 422 and reused.json()["code"] == "idempotency_key_reused", reused.text
            # "with another payload" only where the payload is all that differs
            told = f"is that of deposit on accounts/{account}{' with another payload' if url.endswith(f'{account}/deposit') else ''}: "
            assert told in reused.json()["detail"], reused.text
        command = (await c.get(f"/v1/commands/dep-{account}")).json()
        assert command["payload_digest"] == payload_digest({"amount": 10})
        r = await c.get(f"/v1/accounts/{account}")
        assert r.json()["state"]["balance"] == 10 and r.json()["version"] == 2
        events = await read_topic(settings, events_topic(settings, "accounts"))
        assert [e["type"] for k, e, _ in events if k == account.encode()] == ["Opened", "Deposited"]
        assert [e["type"] for k, e, _ in events if k == other.encode()] == ["Opened"]


@pytest.mark.parametrize("on", ["the same aggregate", "another of its partition"])
async def test_a_key_reused_for_another_command_while_the_first_is_in_flight_is_refused_once_the_first_is_decided(
    settings: Settings, on: str
) -> None:
    registry = load_registry(settings.domain)
    patient = settings.model_copy(update={"api": settings.api.model_copy(update={"outcome_timeout_s": 60})})
    async with system(patient, processors=0) as s:
        c, account = s.client, new_id()
        # the processor keeps a command id's outcome per partition: a reused key on any
        # aggregate whose commands land there is dropped as the first command's duplicate
        partition = partition_for(account.encode(), settings.topics.partitions)
        second = account if on == "the same aggregate" else next(
            other for other in (f"{account}-{n}" for n in range(1000)) if partition_for(other.encode(), settings.topics.partitions) == partition
        )
        key = {"Idempotency-Key": f"in-flight-{account}"}
        # both stored before any processor runs, the open first: the deposit under its key
        # comes while the open is in flight
        opening = asyncio.create_task(c.post(f"/v1/accounts/{account}/open", json={"owner": "ada"}, headers=key))
        await wait_for(lambda: commands_stored(settings, 1), 30, "the open command is stored")
        depositing = asyncio.create_task(c.post(f"/v1/accounts/{second}/deposit", json={"amount": 5}, headers=key))
        await wait_for(lambda: commands_stored(settings, 2), 30, "the deposit is stored")
        async with processor(settings, registry):
            opened, reused = await asyncio.wait_for(asyncio.gather(opening, depositing), 30)
        assert opened.status_code == 200 and opened.json()["version"] == 1, opened.text
        # refused as soon as the open is decided (the processor drops the deposit as its
        # duplicate), not left waiting for an outcome that never comes
        assert reused.status_code == 422 and reused.json()["code"] == "idempotency_key_reused", reused.text
        assert f"is that of open on accounts/{account}" in reused.json()["detail"]
        r = await c.get(f"/v1/accounts/{account}")
        assert r.json()["version"] == 1 and r.json()["state"]["balance"] == 0


async def commands_stored(settings: Settings, count: int) -> bool:
    return len(await read_topic(settings, TopicNames(settings.app).commands)) >= count


async def test_respond_async_and_the_command_resource(settings: Settings) -> None:
    async with system(settings) as s:
        c, account = s.client, new_id()
        r = await c.post(
            f"/v1/accounts/{account}/open",
            json={"owner": "ada"},
            headers={"Prefer": "respond-async", "Idempotency-Key": f"open-{account}"},
        )
        assert r.status_code == 202
        assert r.headers["location"] == f"/v1/commands/open-{account}"
        assert r.headers["preference-applied"] == "respond-async"
        for _ in range(200):
            r = await c.get(f"/v1/commands/open-{account}")
            if r.status_code == 200:
                break
            await asyncio.sleep(0.05)
        assert r.status_code == 200
        assert r.json()["status"] == "accepted" and r.json()["version"] == 1 and r.json()["http_status"] == 200
        r = await c.get(f"/v1/accounts/{account}?min_version=1")
        assert r.status_code == 200 and r.json()["version"] == 1


async def test_no_outcome_in_time_is_503_and_the_command_is_still_processed(settings: Settings) -> None:
    registry = load_registry(settings.domain)
    quick = settings.model_copy(update={"api": settings.api.model_copy(update={"outcome_timeout_s": 0.5})})
    async with system(quick, processors=0) as s:
        c, account = s.client, new_id()
        r = await c.post(f"/v1/accounts/{account}/open", json={"owner": "ada"}, headers={"Idempotency-Key": f"o-{account}"})
        assert r.status_code == 503
        assert r.headers["retry-after"] == "1"
        assert r.headers["location"] == f"/v1/commands/o-{account}"
        assert r.json()["code"] == "outcome_pending"
        r = await c.get(f"/v1/accounts/{account}?min_version=1")
        assert r.status_code == 503 and r.headers["retry-after"]
        # The Location of the 503, and of a 202 `respond-async`, is pending until the
        # outcome is in: the command is stored, not unknown.
        r = await c.get(f"/v1/commands/o-{account}")
        assert r.status_code == 202 and r.json() == {"command_id": f"o-{account}", "status": "pending"}
        later = new_id()
        r = await c.post(f"/v1/accounts/{later}/open", json={"owner": "bo"}, headers={"Prefer": "respond-async"})
        assert r.status_code == 202
        location = r.headers["location"]
        r = await c.get(location)
        assert r.status_code == 202 and r.json()["status"] == "pending"
        # The command was acknowledged: once a processor runs, its outcome appears.
        async with processor(settings, registry):
            r = await c.get(f"/v1/accounts/{account}?min_version=1")
            assert r.status_code == 200
            r = await c.get(f"/v1/commands/o-{account}")
            assert r.status_code == 200 and r.json()["status"] == "accepted"
            r = await c.get(f"/v1/accounts/{later}?min_version=1")
            assert r.status_code == 200
            r = await c.get(location)
            assert r.status_code == 200 and r.json()["aggregate_id"] == later


async def test_auth(settings: Settings) -> None:
    secured = settings.model_copy(update={"api": settings.api.model_copy(update={"auth_tokens": ["s3cret"]})})
    async with system(secured) as s:
        c, account = s.client, new_id()
        r = await c.post(f"/v1/accounts/{account}/open", json={"owner": "ada"})
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        r = await c.post(f"/v1/accounts/{account}/open", json={"owner": "ada"}, headers={"Authorization": "Bearer nope"})
        assert r.status_code == 403
        r = await c.post(f"/v1/accounts/{account}/open", json={"owner": "ada"}, headers={"Authorization": "Bearer s3cret"})
        assert r.status_code == 200
        assert (await c.get("/healthz")).status_code == 200


async def test_openapi_health_and_metrics(settings: Settings) -> None:
    async with system(settings) as s:
        c = s.client
        spec = (await c.get("/openapi.json")).json()
        schemas = spec["components"]["schemas"]
        assert schemas["accounts.Deposit"]["properties"]["amount"]["type"] == "integer"
        assert schemas["orders.Place"]["required"] == ["customer_id", "lines"]
        assert schemas["accounts.events.Opened"]["x-schema-version"] == 2
        assert "orders.events.Placed" in schemas and "orders.State" in schemas
        body = spec["paths"]["/v1/accounts/{id}/deposit"]["post"]["requestBody"]
        assert body["content"]["application/json"]["schema"]["$ref"] == "#/components/schemas/accounts.Deposit"
        assert (await c.get("/healthz")).json() == {"status": "ok"}
        assert (await c.get("/readyz")).status_code == 200
        await open_account(c, new_id())
        metrics = (await c.get("/metrics")).text
        # the API's own (the processor in this test's process has its own /metrics)
        assert "esk_api_kafka_away 0.0" in metrics and "esk_commands_total" not in metrics
        assert (await c.get("/docs")).status_code == 200


def _samples(metrics: str, name: str) -> dict[tuple[str, ...], float]:
    """The samples of `name` in /metrics' text, by their label values (in label order)."""
    return {
        tuple(sample.labels.values()): sample.value
        for family in text_string_to_metric_families(metrics)
        for sample in family.samples
        if sample.name == name
    }


async def test_requests_are_counted_and_timed_by_route_template(settings: Settings) -> None:
    """/metrics counts every request by its route's template, not its path (an id would make
    a series per aggregate), a command's and a read's alike; one no route took (a 404 path)
    under `unrouted`; and times each."""
    async with system(settings) as s:
        c, account = s.client, new_id()
        before = _samples((await c.get("/metrics")).text, "esk_http_requests_total")  # by (method, route, status)
        await open_account(c, account, deposit=5)
        assert (await c.head(f"/v1/accounts/{account}")).status_code == 200
        assert (await c.get("/v1/commands/no%2Fsuch")).status_code == 404
        assert (await c.get(f"/v2/accounts/{account}")).status_code == 404
        for method in ("PROPFIND", "MKCOL"):  # methods the server knows, the API not: one series, not one each
            assert (await c.request(method, f"/v3/{method}")).status_code == 404
        metrics = (await c.get("/metrics")).text
        after = _samples(metrics, "esk_http_requests_total")
        added = {key: n - before.get(key, 0) for key, n in after.items() if n != before.get(key, 0)}
        assert added == {
            ("POST", "/v1/accounts/{id}/open", "200"): 1,
            ("POST", "/v1/accounts/{id}/deposit", "200"): 1,
            ("HEAD", "/v1/{type_name}/{id}", "200"): 1,
            ("GET", "/v1/commands/{command_id}", "404"): 1,
            ("GET", "unrouted", "404"): 1,
            ("other", "unrouted", "404"): 2,
            ("GET", "/metrics", "200"): 1,  # the read before
        }
        assert _samples(metrics, "esk_http_request_seconds_count")[("POST", "/v1/accounts/{id}/deposit")] >= 1


@pytest.mark.parametrize(
    ("read_models", "reason"),
    [
        ("no_such_module:READ_MODELS", "no module 'no_such_module'"),
        ("tests.api.broken_read_models:READ_MODELS", "broken_read_models.py:4: RuntimeError: a bug in the user's read models module"),
    ],
    ids=["not there", "raises as it is imported"],
)
async def test_a_read_models_setting_that_names_nothing_is_a_problem_not_a_crash(
    settings: Settings, read_models: str, reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    """ESK_READ_MODELS set to a module that is not there, or fails as it is imported: reads
    of read models answer 503 with the reason (G8), said in a WARNING at the API's start,
    and the rest of the API serves as ever."""
    broken = settings.model_copy(update={"read_models": read_models})
    assert "read_models" in broken.model_fields_set
    caplog.set_level(logging.WARNING, logger="esk.api.http")
    async with system(broken) as s:
        [told] = [r.getMessage() for r in caplog.records if "read_models_misconfigured" in r.getMessage()]
        assert reason in told and told.endswith(": reads of read models answer 503 read_models_misconfigured"), told
        r = await s.client.get("/v1/projections/anything")
        assert r.status_code == 503 and r.json()["code"] == "read_models_misconfigured", r.text
        assert reason in r.json()["detail"]
        await open_account(s.client, new_id())


async def test_a_request_the_server_fails_to_answer_is_a_problem_and_its_traceback_is_logged(
    settings: Settings, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A defect (here, a read of the read models that raises what nothing expects) answers
    500 as a problem, as every error does, not Starlette's plain text; the log keeps why."""
    from esk.projections.reader import ReadModelRows

    def defect(_rows: ReadModelRows, _name: str) -> None:
        raise RuntimeError("a defect nothing expects")

    monkeypatch.setattr(ReadModelRows, "model", defect)
    async with system(settings) as s:
        r = await s.client.get("/v1/projections/anything")
        assert (r.status_code, r.headers["content-type"], r.json()["code"]) == (500, PROBLEM, "internal_error"), r.text
        assert "a defect" not in r.text  # the client is not told the server's insides
        assert any(rec.exc_info and "a defect nothing expects" in str(rec.exc_info[1]) for rec in caplog.records)
        await open_account(s.client, new_id())  # the API serves on


async def _healthz(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes:
    """One GET /healthz on an open connection; its answer's status line."""
    writer.write(b"GET /healthz HTTP/1.1\r\nHost: esk\r\n\r\n")
    await writer.drain()
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
    await reader.readexactly(length)
    return head.split(b"\r\n")[0]


async def test_an_idle_connection_stays_open_as_long_as_configured(settings: Settings) -> None:
    """A proxy in front reuses idle connections until its own idle timeout (60 s for most);
    the API must not close them first, as uvicorn's default of 5 s does."""
    for keep_alive_s, idle_s, stays_open in ((None, 5.5, True), (1, 2.0, False)):
        api_settings = settings.api if keep_alive_s is None else settings.api.model_copy(update={"keep_alive_s": keep_alive_s})
        async with system(settings.model_copy(update={"api": api_settings}), processors=0) as s:
            url = s.client.base_url
            assert url.host is not None and url.port is not None
            reader, writer = await asyncio.open_connection(url.host, url.port)
            try:
                assert await _healthz(reader, writer) == b"HTTP/1.1 200 OK"
                await asyncio.sleep(idle_s)
                if stays_open:
                    assert await _healthz(reader, writer) == b"HTTP/1.1 200 OK"
                else:
                    assert await reader.read() == b""  # the server closed it
            finally:
                writer.close()
