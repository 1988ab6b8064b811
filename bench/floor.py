"""The stack's floor: the least a PD proxy on Narwhal's HTTP stack (aiohttp, orjson) can do.

`python -m bench.floor --port P --prefill URL --decode URL [--decode URL...]` serves
`/v1/completions` and `/v1/chat/completions` with exactly the wire work any vLLM PD proxy must
do — read the body, send the prefill leg, parse its answer, send the decode leg with the
handoff, relay the answer (bytes, streamed or not) — and nothing else: no validation,
deadlines, placement, evidence or metrics.
It is not a router. Measured beside Narwhal in the same run, it shows how much of Narwhal's added
latency and per-stream memory is the HTTP stack's and how much is Narwhal's own.
"""

from __future__ import annotations

import argparse
import itertools
import socket
import sys
from collections.abc import Awaitable, Callable

import aiohttp
import orjson
from aiohttp import web

from narwhal.engine.vllm import PREFILL_KV_PARAMS

_HEADERS = {"Content-Type": "application/json"}


def client_session() -> aiohttp.ClientSession:
    """The engines' side: one pooled session, bodies passed as bytes."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=4096, family=socket.AF_UNSPEC),
        auto_decompress=False,
        skip_auto_headers=("User-Agent",),
        cookie_jar=aiohttp.DummyCookieJar(),
    )


async def relay(
    request: web.Request, r: aiohttp.ClientResponse, stream: bool
) -> web.StreamResponse:
    """The decode leg's answer to the client, as it comes (streamed or whole)."""
    if not stream:
        return web.Response(body=await r.read(), content_type="application/json")
    out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await out.prepare(request)
    async for chunk in r.content.iter_any():
        await out.write(chunk)
    await out.write_eof()
    return out


def application(
    completions: Callable[[web.Request], Awaitable[web.StreamResponse]],
    session: dict[str, aiohttp.ClientSession],
) -> web.Application:
    """`/v1/completions`, `/v1/chat/completions` and `/health`, with `session["s"]` open
    while the app runs."""

    async def start(_: web.Application) -> None:
        session["s"] = client_session()

    async def stop(_: web.Application) -> None:
        await session["s"].close()

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", completions)
    app.router.add_get("/health", health)
    return app


def serve(app: web.Application, port: int) -> None:
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=lambda *_: None)


def app(prefill: str, decode: list[str]) -> web.Application:
    session: dict[str, aiohttp.ClientSession] = {}
    turn = itertools.cycle(decode)

    async def completions(request: web.Request) -> web.StreamResponse:
        s = session["s"]
        body = orjson.loads(await request.read())
        first = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": PREFILL_KV_PARAMS}
        path = request.path
        async with s.post(prefill + path, data=orjson.dumps(first), headers=_HEADERS) as r:
            handoff = orjson.loads(await r.read())["kv_transfer_params"]
        body["kv_transfer_params"] = handoff
        async with s.post(next(turn) + path, data=orjson.dumps(body), headers=_HEADERS) as r:
            return await relay(request, r, bool(body.get("stream")))

    return application(completions, session)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.floor", description=__doc__.split("\n")[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--prefill", required=True)
    p.add_argument("--decode", required=True, action="append")
    args = p.parse_args(argv)
    serve(app(args.prefill, args.decode), args.port)


if __name__ == "__main__":
    main(sys.argv[1:])
