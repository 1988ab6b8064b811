"""What each engine receives (DESIGN §1): the prefill body, the decode body, and headers.

The sims record every completion request (`/sim/requests`: path, headers, body, leg), so
these tests compare the exact JSON each leg got against the client's body.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from tests.support.router import RunningRouter, StartRouter
from tests.support.sim_process import SimFactory, SimProcess

MODEL = "demo-model"
PREFILL_ENGINE_ID = "sim-prefill-0"
PREFILL_KV = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
HANDOFF_KEYS = {
    "do_remote_prefill",
    "do_remote_decode",
    "remote_engine_id",
    "remote_block_ids",
    "remote_request_id",
    "remote_host",
    "remote_port",
    "tp_size",
}
# What a hostile client might send to steer the decode engine's KV read elsewhere.
CLIENT_KV = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_engine_id": "evil",
    "remote_block_ids": [1, 2, 3],
    "remote_request_id": "evil-req",
    "remote_host": "203.0.113.9",
    "remote_port": 4444,
}


@dataclass
class Sims:
    prefill: SimProcess
    decode: SimProcess


@pytest.fixture(scope="module")
def sims() -> Iterator[Sims]:
    factory = SimFactory()
    try:
        prefill, decode = factory.start_many(
            [["--role", "prefill", "--kv-role", "kv_producer", "--itl-ms", "0",
              "--engine-id", PREFILL_ENGINE_ID],
             ["--role", "decode", "--kv-role", "kv_consumer", "--itl-ms", "0"]]
        )  # fmt: skip
        yield Sims(prefill, decode)
    finally:
        factory.close()


@pytest.fixture
def clean(sims: Sims) -> Sims:
    for sim in (sims.prefill, sims.decode):
        sim.clear_faults()
        sim.clear_requests()
    return sims


def _engines(sims: Sims, **extra: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {"id": "p0", "url": sims.prefill.url, "role": "prefill", **extra.get("p0", {})},
        {"id": "d0", "url": sims.decode.url, "role": "decode", **extra.get("d0", {})},
    ]


@pytest.fixture
async def rr(clean: Sims, start_router: StartRouter) -> RunningRouter:
    return await start_router(_engines(clean))


def _header(entry: dict[str, Any], name: str) -> str | None:
    """A recorded header, case-insensitively; None when absent."""
    found = [v for k, v in entry["headers"].items() if k.lower() == name.lower()]
    assert len(found) <= 1, entry["headers"]
    return found[0] if found else None


async def _post(
    http: aiohttp.ClientSession,
    rr: RunningRouter,
    path: str,
    body: dict[str, Any],
    headers: dict[str, str] | None = None,
) -> bytes:
    async with http.post(rr.url + path, json=body, headers=headers) as resp:
        raw = await resp.read()
        assert resp.status == 200, raw
        return raw


def _only(sim: SimProcess, leg: str) -> dict[str, Any]:
    entries = sim.requests()
    assert [e["leg"] for e in entries] == [leg], entries
    return entries[0]


COMPLETION_BODY: dict[str, Any] = {
    "model": MODEL,
    "prompt": "tell me about the arctic ocean and its whales",
    "max_tokens": 7,
    "min_tokens": 2,
    "temperature": 0.4,
    "top_p": 0.9,
    "seed": 11,
    "stop": ["zzzz"],
    "user": "client-7",
    "logprobs": None,
}
CHAT_BODY: dict[str, Any] = {
    "model": MODEL,
    "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "name a whale"}]},
    ],
    "max_completion_tokens": 5,
    "max_tokens": 6,
    "min_tokens": 1,
    "min_completion_tokens": 1,
    "temperature": 0.0,
    "response_format": {"type": "text"},
}
BODY_CASES = [
    pytest.param("/v1/completions", COMPLETION_BODY, {}, id="completions"),
    pytest.param("/v1/completions", COMPLETION_BODY,
                 {"stream": True, "stream_options": {"include_usage": True}},
                 id="completions-stream"),
    pytest.param("/v1/completions", COMPLETION_BODY, {"stream": False},
                 id="completions-stream-false"),
    pytest.param("/v1/chat/completions", CHAT_BODY, {}, id="chat"),
    pytest.param("/v1/chat/completions", CHAT_BODY,
                 {"stream": True, "stream_options": {"include_usage": False}}, id="chat-stream"),
    pytest.param("/v1/completions", {"model": MODEL, "prompt": "no max tokens at all"}, {},
                 id="completions-no-max-tokens"),
    pytest.param("/v1/chat/completions",
                 {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 3},
                 {"stream": True}, id="chat-only-max-completion-tokens-no-model"),
]  # fmt: skip


@pytest.mark.parametrize("with_client_kv", [False, True], ids=["plain", "client-kv-params"])
@pytest.mark.parametrize(("path", "base", "extra"), BODY_CASES)
async def test_prefill_and_decode_bodies(
    rr: RunningRouter,
    clean: Sims,
    http: aiohttp.ClientSession,
    path: str,
    base: dict[str, Any],
    extra: dict[str, Any],
    with_client_kv: bool,
) -> None:
    client_body = {**copy.deepcopy(base), **extra}
    sent = dict(client_body)
    if with_client_kv:
        sent["kv_transfer_params"] = dict(CLIENT_KV)
    await _post(http, rr, path, sent)

    prefill = _only(clean.prefill, "prefill")
    decode = _only(clean.decode, "decode")
    assert prefill["path"] == decode["path"] == path

    # Prefill: the client's body, one token, not streamed, asking the engine to keep the KV.
    expected_prefill = {
        k: v
        for k, v in client_body.items()
        if k not in ("stream_options", "min_tokens", "min_completion_tokens")
    }
    expected_prefill["max_tokens"] = 1
    if "max_completion_tokens" in client_body:
        expected_prefill["max_completion_tokens"] = 1
    expected_prefill["stream"] = False
    expected_prefill["kv_transfer_params"] = PREFILL_KV
    assert prefill["body"] == expected_prefill

    # Decode: the client's body untouched, plus the prefill engine's handoff.
    handoff = decode["body"]["kv_transfer_params"]
    assert {k: v for k, v in decode["body"].items() if k != "kv_transfer_params"} == client_body
    assert set(handoff) == HANDOFF_KEYS
    assert handoff["do_remote_prefill"] is True
    assert handoff["remote_engine_id"] == PREFILL_ENGINE_ID
    assert handoff["remote_host"] == "127.0.0.1"
    assert handoff["remote_port"] != 4444 and isinstance(handoff["remote_port"], int)
    assert handoff["remote_request_id"] != CLIENT_KV["remote_request_id"]
    blocks = handoff["remote_block_ids"]
    assert blocks and all(isinstance(b, int) for b in blocks)


async def test_client_kv_params_are_dropped_when_the_prefill_finishes_the_request(
    rr: RunningRouter, clean: Sims, http: aiohttp.ClientSession
) -> None:
    """A stop on the prefill's token: no decode leg, and the prefill never saw the client's KV."""
    probe = {"model": MODEL, "prompt": "short prompt here", "max_tokens": 4}
    raw = await _post(http, rr, "/v1/completions", probe)
    word = json.loads(raw)["choices"][0]["text"].split()[0]
    clean.prefill.clear_requests()
    clean.decode.clear_requests()
    body = {**probe, "stop": [word], "kv_transfer_params": dict(CLIENT_KV)}
    answer = json.loads(await _post(http, rr, "/v1/completions", body))
    assert answer["choices"][0]["finish_reason"] == "stop"
    assert "kv_transfer_params" not in answer
    assert _only(clean.prefill, "prefill")["body"]["kv_transfer_params"] == PREFILL_KV
    assert clean.decode.requests() == []


async def test_same_request_id_on_both_legs_and_fresh_per_request(
    rr: RunningRouter, clean: Sims, http: aiohttp.ClientSession
) -> None:
    body = {"model": MODEL, "prompt": "one two three", "max_tokens": 3}
    await _post(http, rr, "/v1/completions", body)
    await _post(
        http, rr, "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": "x"}]}
    )
    prefill, decode = clean.prefill.requests(), clean.decode.requests()
    assert len(prefill) == len(decode) == 2
    ids = []
    for p, d in zip(prefill, decode, strict=True):
        rid = _header(p, "X-Request-Id")
        assert rid
        assert _header(d, "X-Request-Id") == rid
        ids.append(rid)
    assert ids[0] != ids[1]


async def test_client_authorization_is_not_forwarded(
    rr: RunningRouter, clean: Sims, http: aiohttp.ClientSession
) -> None:
    body = {"model": MODEL, "prompt": "secret stuff", "max_tokens": 2, "stream": True}
    await _post(http, rr, "/v1/completions", body, {"Authorization": "Bearer client-secret"})
    for entry in (_only(clean.prefill, "prefill"), _only(clean.decode, "decode")):
        assert _header(entry, "Authorization") is None
        assert "client-secret" not in repr(entry["headers"])


@pytest.mark.parametrize("source", ["api_key", "api_key_env"])
async def test_engine_api_key_is_sent_as_bearer(
    clean: Sims,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
    monkeypatch: pytest.MonkeyPatch,
    source: str,
) -> None:
    if source == "api_key":
        keys = {"p0": {"api_key": "key-prefill"}, "d0": {"api_key": "key-decode"}}
    else:
        monkeypatch.setenv("NARWHAL_TEST_P0_KEY", "key-prefill")
        monkeypatch.setenv("NARWHAL_TEST_D0_KEY", "key-decode")
        keys = {"p0": {"api_key_env": "NARWHAL_TEST_P0_KEY"},
                "d0": {"api_key_env": "NARWHAL_TEST_D0_KEY"}}  # fmt: skip
    rr = await start_router(_engines(clean, **keys))
    body = {"model": MODEL, "prompt": "keys please", "max_tokens": 2}
    await _post(http, rr, "/v1/completions", body, {"Authorization": "Bearer client-secret"})
    assert _header(_only(clean.prefill, "prefill"), "Authorization") == "Bearer key-prefill"
    assert _header(_only(clean.decode, "decode"), "Authorization") == "Bearer key-decode"


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_both_legs_ask_for_an_uncompressed_answer(
    rr: RunningRouter, clean: Sims, http: aiohttp.ClientSession, stream: bool
) -> None:
    """The router relays the decode's bytes as they are and parses the prefill's handoff from
    its raw body: neither engine may be invited to compress (aiohttp offers gzip by default)."""
    body = {"model": MODEL, "prompt": "plain bytes please", "max_tokens": 3, "stream": stream}
    await _post(http, rr, "/v1/completions", body, {"Accept-Encoding": "gzip, br"})
    assert _header(_only(clean.prefill, "prefill"), "Accept-Encoding") == "identity"
    assert _header(_only(clean.decode, "decode"), "Accept-Encoding") == "identity"


# ----------------------------------------------- handoff variants other connectors send
MINIMAL_HANDOFF: dict[str, Any] = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_engine_id": "old-prefill",
    "remote_block_ids": [4, 5, 6],
    "remote_request_id": "p-1",
    "remote_host": "10.1.2.3",
    "remote_port": 5601,
}
HANDOFF_VARIANTS = [
    pytest.param(MINIMAL_HANDOFF, id="no-tp-size"),
    pytest.param({**MINIMAL_HANDOFF, "remote_block_ids": [[4, 5], [9, 10, 11]], "tp_size": 2},
                 id="hybrid-nested-block-ids"),
    pytest.param({**MINIMAL_HANDOFF, "remote_block_ids": [[4]], "future_field": {"a": [1]}},
                 id="unknown-fields-kept"),
]  # fmt: skip


class NixlEngine:
    """A fake vLLM engine: as prefill it answers with `handoff`; as decode it records the
    `kv_transfer_params` it is given and answers a plain completion."""

    def __init__(self, handoff: dict[str, Any]) -> None:
        self.handoff = handoff
        self.decoded: list[Any] = []
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def completions(self, request: web.Request) -> web.Response:
        body = await request.json()
        kv = body.get("kv_transfer_params") or {}
        answer: dict[str, Any] = {
            "id": "cmpl-x",
            "object": "text_completion",
            "model": MODEL,
            "choices": [{"index": 0, "text": " whale", "finish_reason": "length"}],
        }
        if kv.get("do_remote_decode") is True:
            answer["kv_transfer_params"] = self.handoff
        else:
            self.decoded.append(kv)
        return web.json_response(answer)

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/health", _health)
        app.router.add_get("/v1/models", _models)  # verified: serves demo-model
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"


async def _models(_: web.Request) -> web.Response:
    """vLLM's model list naming the served model, so the router verifies this fake."""
    return web.json_response({"object": "list", "data": [{"id": "demo-model"}]})


async def _health(_: web.Request) -> web.Response:
    return web.Response(text="ok")


@pytest.mark.parametrize("handoff", HANDOFF_VARIANTS)
async def test_other_connector_handoffs_reach_the_decode_unchanged(
    start_router: StartRouter, http: aiohttp.ClientSession, handoff: dict[str, Any]
) -> None:
    """A healthy prefill speaking an older or hybrid-model NixlConnector dialect is not a
    `kv_handoff` failure: its handoff goes to the decode exactly as it came (docs/engines.md)."""
    prefill, decode = NixlEngine(handoff), NixlEngine({})
    await prefill.start()
    await decode.start()
    try:
        rr = await start_router(
            [{"id": "p0", "url": prefill.url, "role": "prefill"},
             {"id": "d0", "url": decode.url, "role": "decode"}],
            controller={"monitor_interval_s": 30.0},
        )  # fmt: skip
        body = {"model": MODEL, "prompt": "name a whale", "max_tokens": 2}
        answer = json.loads(await _post(http, rr, "/v1/completions", body))
        assert answer["choices"][0]["text"] == " whale"
        assert decode.decoded == [handoff]
        assert rr.router.fleet.get("p0").evidence == {}
    finally:
        for engine in (prefill, decode):
            if engine.runner is not None:
                await engine.runner.cleanup()
