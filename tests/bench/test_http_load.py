"""The load generator's HTTP client against a real uvicorn server: statuses, bodies of any
size, keep-alive reuse and expiry, a server that closes the connection, and an unreachable server."""

from __future__ import annotations

import asyncio

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from bench.http_load import HttpClient, _post
from esk.broker.ports import free_port
from tests.system import wait_for

peers: set[tuple[str, int]] = set()


async def answer(request: Request) -> Response:
    assert request.client is not None
    peers.add((request.client.host, request.client.port))
    body = await request.body()
    status = int(request.path_params["status"])
    headers = {"Connection": "close"} if request.headers.get("x-close") else None
    return Response(body * 1000, status_code=status, headers=headers)


async def test_statuses_keep_alive_and_closed_connections() -> None:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(Starlette(routes=[Route("/s/{status}", answer, methods=["POST"])]),
                                           host="127.0.0.1", port=port, log_level="warning"))
    serving = asyncio.create_task(server.serve())
    client = HttpClient(f"http://127.0.0.1:{port}", timeout_s=10, idle_max_s=1.0)
    try:
        await wait_for(lambda: server.started, what="server started")
        statuses = [await client.post(f"/s/{s}", b"x" * 100, {"Content-Type": "text/plain"}) for s in (200, 422, 404, 200)]
        assert statuses == [200, 422, 404, 200]
        assert len(peers) == 1  # one connection, kept alive
        assert await client.post("/s/409", b"y", {"X-Close": "1"}) == 409
        assert await client.post("/s/200", b"z", {}) == 200  # on a new connection
        assert len(peers) == 2
        many = await asyncio.gather(*(client.post("/s/200", b"w", {}) for _ in range(50)))
        assert many == [200] * 50
        peers.clear()
        await client.post("/s/200", b"v", {})
        await asyncio.sleep(1.2)  # past idle_max_s: the connection is not used again
        await client.post("/s/200", b"u", {})
        assert len(peers) == 2
    finally:
        client.close()
        server.should_exit = True
        await serving
    answer_now = await _post(HttpClient(f"http://127.0.0.1:{port}", timeout_s=1), ("/s/200", b"", {}, "id"))
    assert isinstance(answer_now, str) and answer_now.startswith("ConnectionRefusedError")
