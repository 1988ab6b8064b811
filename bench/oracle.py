"""The `cache` suite's oracle: a PD proxy that knows every prefill engine's true cache.

`python -m bench.oracle --port P --prefill URL [--prefill URL...] --decode URL [...]` serves
`/v1/completions` as `bench.floor` does (a prefill leg, then the decode leg with its handoff,
relayed as is), but before each prefill it asks every prefill sim what the prompt would hit
now (`POST /sim/cache/match`, the sim's own cache, no estimate) and sends it to the engine
with the longest cached prefix; ties go to the engine with the fewest requests in flight from
here, and decode legs to the decode engine with the fewest. It bounds the hit rate a router
can reach on a workload (no router knows more than the engines do) while still spreading new
prefixes by load. Not a router: the asking costs a round trip to every engine per request.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

import aiohttp
import orjson
from aiohttp import web

from bench.floor import application, relay, serve
from narwhal.engine.vllm import PREFILL_KV_PARAMS

_HEADERS = {"Content-Type": "application/json"}


def app(prefill: list[str], decode: list[str]) -> web.Application:
    session: dict[str, aiohttp.ClientSession] = {}
    in_flight = {url: 0 for url in (*prefill, *decode)}

    async def cached(url: str, raw: bytes) -> int:
        async with session["s"].post(url + "/sim/cache/match", data=raw, headers=_HEADERS) as r:
            return int(orjson.loads(await r.read())["cached_tokens"]) if r.status == 200 else 0

    async def choose_prefill(raw: bytes) -> str:
        hits = await asyncio.gather(*(cached(url, raw) for url in prefill))
        return max(prefill, key=lambda u: (hits[prefill.index(u)], -in_flight[u]))

    async def completions(request: web.Request) -> web.StreamResponse:
        s = session["s"]
        raw = await request.read()
        body = orjson.loads(raw)
        first = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": PREFILL_KV_PARAMS}
        path = request.path
        engine = await choose_prefill(raw)
        in_flight[engine] += 1
        try:
            async with s.post(engine + path, data=orjson.dumps(first), headers=_HEADERS) as r:
                handoff = orjson.loads(await r.read())["kv_transfer_params"]
        finally:
            in_flight[engine] -= 1
        body["kv_transfer_params"] = handoff
        target = min(decode, key=lambda u: in_flight[u])
        in_flight[target] += 1
        try:
            async with s.post(target + path, data=orjson.dumps(body), headers=_HEADERS) as r:
                return await relay(request, r, bool(body.get("stream")))
        finally:
            in_flight[target] -= 1

    return application(completions, session)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.oracle", description=__doc__.split("\n")[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--prefill", required=True, action="append")
    p.add_argument("--decode", required=True, action="append")
    args = p.parse_args(argv)
    serve(app(args.prefill, args.decode), args.port)


if __name__ == "__main__":
    main(sys.argv[1:])
