"""The engine transport over a real socket: what the router sends engines, request to request."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from narwhal.engine.transport import EngineClient, PoolKind


@pytest.fixture
async def engine() -> AsyncIterator[tuple[str, list[str | None]]]:
    """An engine that sets a cookie on every answer and records the Cookie header it gets."""
    seen: list[str | None] = []

    async def completions(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Cookie"))
        response = web.json_response({"choices": []})
        response.set_cookie("session", "engine-affinity")
        return response

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    yield f"http://localhost:{port}", seen  # a host name: aiohttp keeps no cookies for IPs
    await runner.cleanup()


async def test_an_engines_cookie_never_rides_on_later_requests(
    engine: tuple[str, list[str | None]],
) -> None:
    url, seen = engine
    client = EngineClient(4, 4)
    await client.start()
    try:
        for pool in (PoolKind.DATA, PoolKind.DATA, PoolKind.CONTROL):
            reply = await client.post(pool, url + "/v1/completions", b"{}", {}, 5.0)
            assert reply.status == 200
    finally:
        await client.close()
    # Requests from unrelated clients share the router's sessions: a cookie one engine answer
    # set must not be sent with the next request.
    assert seen == [None, None, None]
