"""The rules /openapi.json states for ids, keys and payloads are the ones the server applies."""

from __future__ import annotations

import asyncio
import socket
import uuid

import pytest

from esk.settings import Settings
from tests.system import system

pytestmark = pytest.mark.kafka


async def test_ids_keys_and_numbers_are_taken_as_the_document_states_them(settings: Settings, caplog: pytest.LogCaptureFixture) -> None:
    async with system(settings) as s:
        c, account = s.client, uuid.uuid4().hex[:12]
        deposit = f"/v1/accounts/{account}/deposit"
        r = await c.post(f"/v1/accounts/{account}/open", json={"owner": "ada"})
        assert r.status_code == 200, r.text

        # JSON Schema's integers: 5.0 is one; "5", true and what does not fit 64 bits are not.
        r = await c.post(deposit, content=b'{"amount": 5.0}', headers={"Content-Type": "application/json"})
        assert r.status_code == 200 and r.json()["events"][0]["data"] == {"amount": 5}
        for amount in ('"5"', "true", str(2**70)):
            r = await c.post(deposit, content=f'{{"amount": {amount}}}'.encode(), headers={"Content-Type": "application/json"})
            assert r.status_code == 422 and r.json()["errors"][0]["loc"] == ["amount"], (amount, r.text)

        # An Idempotency-Key that is there is checked, empty or not; HTTP carries visible ASCII.
        for key in (b"", "clé".encode("latin-1"), b"."):
            r = await c.post(deposit, json={"amount": 1}, headers={"Idempotency-Key": key})
            assert r.status_code == 400 and r.json()["code"] == "invalid_idempotency_key", (key, r.text)
        # so are the ids copied onto each event: an id's size at most
        for header in ("X-Correlation-Id", "X-Causation-Id"):
            r = await c.post(deposit, json={"amount": 1}, headers={header: "x" * 60_000})
            assert r.status_code == 400 and r.json()["code"] == "invalid_trace_id", (header, r.text)
        r = await c.post(deposit, json={"amount": 1}, headers={"X-Correlation-Id": "req-1", "Prefer": "RESPOND-ASYNC"})
        assert r.status_code == 202, r.text  # a preference's name is case-insensitive
        r = await c.post(deposit, content=b'{"amount": 1}', headers={"Content-Type": 'application/json; charset="UTF-8"'})
        assert r.status_code == 200, r.text  # JSON's own charset, named

        # What two readers of one request could read differently is refused, not read one way:
        # a name twice in one object (orjson keeps the last), a one-value header twice.
        for body, twice in ((b'{"amount": 1, "amount": 1000}', "amount"), (rb'{"amount": 1, "x": {"a": 1, "\u0061": 2}}', "a")):
            r = await c.post(deposit, content=body, headers={"Content-Type": "application/json"})
            assert r.status_code == 400 and r.json()["code"] == "malformed_json", r.text
            assert r.json()["detail"] == f"the body gives {twice!r} twice in one object: which one was meant cannot be told"
        for depth in (65, 1000):  # past esk's bound, and within orjson's (Python's own parsers recursed out on 3.11)
            r = await c.post(deposit, content=b'{"a": ' * depth + b"1" + b"}" * depth, headers={"Content-Type": "application/json"})
            assert r.status_code == 400 and r.json()["detail"] == "the body nests its arrays and objects deeper than 64 levels", r.text
        for header, status, code in (
            ("Idempotency-Key", 400, "invalid_idempotency_key"), ("X-Correlation-Id", 400, "invalid_trace_id"),
            ("Content-Type", 415, "unsupported_media_type"),
        ):
            r = await c.post(deposit, content=b'{"amount": 1}', headers=[("Content-Type", "application/json"), (header, "k1"), (header, "k2")])
            assert (r.status_code, r.json()["code"]) == (status, code), (header, r.text)
            assert r.json()["detail"] == f"{header} is given more than once: send it once"

        # A key may hold what a path must escape: the Location escapes it, and serves the outcome.
        key = f"deposit 1/{account}?"
        r = await c.post(deposit, json={"amount": 1}, headers={"Idempotency-Key": key, "Prefer": "respond-async"})
        assert r.status_code == 202 and r.headers["location"] == f"/v1/commands/deposit%201%2F{account}%3F"
        for _ in range(200):
            outcome = await c.get(r.headers["location"])
            if outcome.status_code == 200:
                break
            await asyncio.sleep(0.05)
        assert outcome.status_code == 200 and outcome.json()["command_id"] == key

        # "." and ".." are dot segments, which clients remove from a URL: no id can be one; nor
        # bytes that are not UTF-8, which arrive as U+FFFD, so that %FF and %FE would be one
        # aggregate.
        for path in (
            "/v1/accounts/%2E%2E", "/v1/accounts/%2E/events", "/v1/accounts/%2E/deposit",
            "/v1/accounts/%FF", "/v1/accounts/%FE/deposit", "/v1/accounts/x%EF%BF%BD",
        ):
            r = await (c.post(path, json={"amount": 1}) if path.endswith("deposit") else c.get(path))
            assert r.status_code == 400 and r.json()["code"] == "invalid_aggregate_id", (path, r.text)
        # nor "/", escaped or not: no aggregate has such an id (not a 405 of another route)
        for path in ("/v1/accounts/a%2Fb", "/v1/accounts/a%2fb/events", "/v1/accounts/a%2Fb/deposit"):
            r = await (c.post(path, json={"amount": 1}) if path.endswith("deposit") else c.get(path))
            assert r.status_code == 404 and "no aggregate has an id with '/' in it" in r.json()["detail"], (path, r.text)

        r = await c.get("/v1/projections/account_balances", params={"limit": 0})
        assert r.status_code == 400 and r.json()["code"] == "invalid_limit"
        r = await c.get("/v1/projections/account_balances", params=[("account_id", "a1"), ("account_id", "a2")])
        assert r.status_code == 400 and r.json()["code"] == "invalid_filter", r.text  # it read a2's alone
        assert r.json()["detail"] == "account_id: given more than once; it takes one value"
        for params, code in (([("limit", "1"), ("limit", "5")], "invalid_limit"), ([("wait_ms", "1"), ("wait_ms", "9")], "invalid_wait")):
            for path in ("/v1/projections/account_balances", f"/v1/accounts/{account}/events"):
                r = await c.get(path, params=params)
                assert r.status_code == 400 and r.json()["code"] == code, (path, r.text)  # the last was taken

        # HEAD is its GET's headers: an aggregate's ETag without its state
        got, head = await c.get(f"/v1/accounts/{account}"), await c.head(f"/v1/accounts/{account}")
        assert head.status_code == 200 and head.content == b"", head.text
        assert head.headers["etag"] == got.headers["etag"] and head.headers["content-length"] == str(len(got.content))
        r = await c.head("/v1/accounts/nosuch-account")
        assert r.status_code == 404 and r.content == b"" and r.headers["content-type"] == "application/problem+json"
        # through the server as a client meets it: no error logged, and the connection
        # goes on to the next request (uvicorn read a GET and waited for its body)
        with socket.create_connection(("127.0.0.1", c.base_url.port or 80), timeout=10) as raw:
            ask = f"HEAD /v1/accounts/{account} HTTP/1.1\r\nHost: x\r\n\r\nGET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
            raw.sendall(ask.encode())
            answers = b""
            while b'"status"' not in answers:
                chunk = await asyncio.to_thread(raw.recv, 65536)
                assert chunk, f"the connection closed after: {answers!r}"
                answers += chunk
        assert answers.startswith(b"HTTP/1.1 200 OK") and answers.count(b"HTTP/1.1 200 OK") == 2, answers
        assert "Exception in ASGI application" not in caplog.text, caplog.text
