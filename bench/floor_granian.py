"""The floor with granian (Rust, hyper) as the serving side: `bench.floor`'s PD relay as an RSGI
app, the engine legs still on an aiohttp client session.

Issue 17's other candidate for a leaner stack: granian replaces only the server half. Started by
the bench as `bench/.venv/bin/granian --interface rsgi --workers 1 --loop uvloop ...
bench.floor_granian:app` (granian and its dependencies live in the bench venv, so this module
cannot import Narwhal), with the engines in `FLOOR_PREFILL` and `FLOOR_DECODE` (comma-separated).
The same wire work as `bench.floor`: read the body, prefill leg with vLLM's
`kv_transfer_params`, parse its JSON, decode leg with the handoff spliced in, relay the bytes.
"""

from __future__ import annotations

import itertools
import os
import socket
from typing import Any

import aiohttp
import orjson

# narwhal.engine.vllm.PREFILL_KV_PARAMS (tests/unit/test_floor_ab.py keeps the two equal)
PREFILL_KV_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
_HEADERS = {"Content-Type": "application/json"}
_JSON = [("content-type", "application/json")]
_SSE = [("content-type", "text/event-stream")]
COMPLETIONS = ("/v1/completions", "/v1/chat/completions")


class App:
    """An RSGI application (`__rsgi__`); the client session opens with the first request."""

    def __init__(self, prefill: str, decode: list[str]) -> None:
        self.prefill = prefill
        self.turn = itertools.cycle(decode)
        self.session: aiohttp.ClientSession | None = None

    def _session(self) -> aiohttp.ClientSession:
        if self.session is None:
            self.session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=4096, family=socket.AF_UNSPEC),
                auto_decompress=False,
                skip_auto_headers=("User-Agent",),
                cookie_jar=aiohttp.DummyCookieJar(),
            )
        return self.session

    async def __rsgi__(self, scope: Any, proto: Any) -> None:
        if scope.method == "POST" and scope.path in COMPLETIONS:
            await self.completions(scope.path, proto)
        elif scope.method == "GET" and scope.path == "/health":
            proto.response_str(200, [("content-type", "text/plain")], "ok")
        else:
            proto.response_empty(404, [])

    async def completions(self, path: str, proto: Any) -> None:
        s = self._session()
        body = orjson.loads(await proto())
        first = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": PREFILL_KV_PARAMS}
        async with s.post(self.prefill + path, data=orjson.dumps(first), headers=_HEADERS) as r:
            handoff = orjson.loads(await r.read())["kv_transfer_params"]
        body["kv_transfer_params"] = handoff
        async with s.post(next(self.turn) + path, data=orjson.dumps(body), headers=_HEADERS) as r:
            if not body.get("stream"):
                proto.response_bytes(200, _JSON, await r.read())
                return
            out = proto.response_stream(200, _SSE)
            async for chunk in r.content.iter_any():
                await out.send_bytes(chunk)


def _from_env() -> App | None:
    prefill = os.environ.get("FLOOR_PREFILL")
    decode = os.environ.get("FLOOR_DECODE")
    return App(prefill, decode.split(",")) if prefill and decode else None


app = _from_env()
