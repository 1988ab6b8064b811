"""What the client can do wrong: bad bodies and prompts longer than the model allows.

Bad input gets a precise OpenAI-style 4xx and never reaches an engine; a prompt longer than
the model allows gets a 400 before any completion request is made (token counting).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.poll import eventually
from tests.support.router import RunningRouter, StartRouter
from tests.support.sim_process import SimFactory, SimProcess

MODEL = "demo-model"
MAX_MODEL_LEN = 64
MAX_BODY_BYTES = 2048


@dataclass
class Sims:
    prefill: SimProcess
    decode: SimProcess

    def all(self) -> tuple[SimProcess, SimProcess]:
        return self.prefill, self.decode


@pytest.fixture(scope="module")
def shared() -> Iterator[Sims]:
    """A small model (64 tokens) for the whole module."""
    factory = SimFactory()
    try:
        prefill, decode = factory.start_many(
            [["--role", "prefill", "--kv-role", "kv_producer",
              "--max-model-len", str(MAX_MODEL_LEN)],
             ["--role", "decode", "--kv-role", "kv_consumer",
              "--max-model-len", str(MAX_MODEL_LEN)]]
        )  # fmt: skip
        yield Sims(prefill, decode)
    finally:
        factory.close()


async def _running(sim: SimProcess) -> float:
    return await asyncio.to_thread(sim.metric, "vllm:num_requests_running")


def _running_is(sim: SimProcess, count: int) -> Any:
    """A probe for `eventually`: the sim has `count` completions in flight."""

    async def probe() -> bool:
        return await _running(sim) == count

    return probe


@pytest.fixture
async def sims(shared: Sims) -> Sims:
    for sim in shared.all():
        sim.clear_faults()
        await eventually(_running_is(sim, 0), timeout_s=5, what="sim idle")
        sim.clear_requests()
    return shared


@pytest.fixture
async def rr(sims: Sims, start_router: StartRouter) -> RunningRouter:
    return await start_router(
        [{"id": "p0", "url": sims.prefill.url, "role": "prefill"},
         {"id": "d0", "url": sims.decode.url, "role": "decode"}],
        serving={"max_body_bytes": MAX_BODY_BYTES},
        recovery={"eject_after": 100},
    )  # fmt: skip


def _assert_error_shape(status: int, content_type: str, raw: bytes, expected: int) -> Any:
    assert status == expected, raw
    assert content_type.startswith("application/json")
    error = json.loads(raw)["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    return error


async def _samples(http: aiohttp.ClientSession, rr: RunningRouter) -> list[Any]:
    async with http.get(rr.url + "/metrics") as resp:
        text = await resp.text()
    return [s for f in text_string_to_metric_families(text) for s in f.samples]


def _total(samples: list[Any], name: str) -> float:
    return sum(s.value for s in samples if s.name == name)


# ----------------------------------------------------------------------- bad bodies

C, CHAT = "/v1/completions", "/v1/chat/completions"
OK_MESSAGES = [{"role": "user", "content": "hi"}]


def _j(obj: Any) -> bytes:
    return json.dumps(obj).encode()


BAD_BODIES = [
    # id, path, raw body, status, param (None: not checked)
    ("invalid-json", C, b'{"model": "demo-model", "prompt": ', 400, None),
    ("invalid-json-chat", CHAT, b"{not json}", 400, None),
    ("empty-body", C, b"", 400, None),
    ("not-an-object", C, _j(["prompt", "x"]), 400, None),
    ("json-string", CHAT, _j("hello"), 400, None),
    ("missing-prompt", C, _j({"model": MODEL, "max_tokens": 3}), 400, "prompt"),
    ("missing-messages", CHAT, _j({"model": MODEL, "prompt": "x"}), 400, "messages"),
    ("prompt-number", C, _j({"model": MODEL, "prompt": 5}), 400, "prompt"),
    ("prompt-null", C, _j({"model": MODEL, "prompt": None}), 400, "prompt"),
    ("prompt-object", C, _j({"model": MODEL, "prompt": {"text": "x"}}), 400, "prompt"),
    ("prompt-empty-list", C, _j({"model": MODEL, "prompt": []}), 400, "prompt"),
    ("prompt-mixed-list", C, _j({"model": MODEL, "prompt": [1, "a"]}), 400, "prompt"),
    ("messages-string", CHAT, _j({"model": MODEL, "messages": "hi"}), 400, "messages"),
    ("messages-empty", CHAT, _j({"model": MODEL, "messages": []}), 400, "messages"),
    ("message-no-role", CHAT, _j({"model": MODEL, "messages": [{"content": "x"}]}), 400, None),
    ("message-not-object", CHAT, _j({"model": MODEL, "messages": ["x"]}), 400, None),
    ("message-content-number", CHAT,
     _j({"model": MODEL, "messages": [{"role": "user", "content": 7}]}), 400, None),
    ("max-tokens-string", C, _j({"model": MODEL, "prompt": "x", "max_tokens": "10"}), 400,
     "max_tokens"),
    ("max-tokens-zero", C, _j({"model": MODEL, "prompt": "x", "max_tokens": 0}), 400,
     "max_tokens"),
    ("max-tokens-float", C, _j({"model": MODEL, "prompt": "x", "max_tokens": 2.5}), 400,
     "max_tokens"),
    ("max-tokens-bool", C, _j({"model": MODEL, "prompt": "x", "max_tokens": True}), 400,
     "max_tokens"),
    ("max-completion-tokens-negative", CHAT,
     _j({"model": MODEL, "messages": OK_MESSAGES, "max_completion_tokens": -1}), 400,
     "max_completion_tokens"),
    ("stream-string", C, _j({"model": MODEL, "prompt": "x", "stream": "yes"}), 400, "stream"),
    ("stream-options-list", C,
     _j({"model": MODEL, "prompt": "x", "stream": True, "stream_options": [1]}), 400,
     "stream_options"),
    ("model-number", C, _j({"model": 5, "prompt": "x"}), 400, "model"),
    ("n-two-streamed", C, _j({"model": MODEL, "prompt": "x", "n": 2, "stream": True}), 400, "n"),
    ("unknown-model", C, _j({"model": "gpt-4o", "prompt": "x"}), 404, "model"),
    ("unknown-model-chat", CHAT, _j({"model": "other", "messages": OK_MESSAGES}), 404, "model"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("path", "raw", "status", "param"), [pytest.param(*c[1:], id=c[0]) for c in BAD_BODIES]
)
async def test_bad_body_is_refused_before_any_engine(
    rr: RunningRouter,
    sims: Sims,
    http: aiohttp.ClientSession,
    path: str,
    raw: bytes,
    status: int,
    param: str | None,
) -> None:
    headers = {"Content-Type": "application/json"}
    async with http.post(rr.url + path, data=raw, headers=headers) as resp:
        error = _assert_error_shape(resp.status, resp.content_type, await resp.read(), status)
    if param is not None:
        assert error["param"] == param
    assert sims.prefill.requests() == [] and sims.decode.requests() == []
    samples = await _samples(http, rr)
    assert _total(samples, "narwhal_engine_failures_total") == 0


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
@pytest.mark.parametrize("path", [C, CHAT])
async def test_body_over_max_body_bytes_is_413(
    rr: RunningRouter, sims: Sims, http: aiohttp.ClientSession, path: str, chunked: bool
) -> None:
    filler = "w " * MAX_BODY_BYTES
    body = (
        {"model": MODEL, "messages": [{"role": "user", "content": filler}]}
        if path == CHAT
        else {"model": MODEL, "prompt": filler}
    )
    raw = _j(body)
    assert len(raw) > MAX_BODY_BYTES

    async def chunks() -> AsyncIterator[bytes]:
        for i in range(0, len(raw), 512):
            yield raw[i : i + 512]

    data: Any = chunks() if chunked else raw
    async with http.post(
        rr.url + path, data=data, headers={"Content-Type": "application/json"}
    ) as resp:
        _assert_error_shape(resp.status, resp.content_type, await resp.read(), 413)
    assert sims.prefill.requests() == [] and sims.decode.requests() == []


async def test_body_at_the_limit_is_served(
    rr: RunningRouter, sims: Sims, http: aiohttp.ClientSession
) -> None:
    base = _j({"model": MODEL, "prompt": "", "max_tokens": 2})
    prompt = "ab " * 10  # keep the prompt itself short: the model has 64 tokens
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "user": ""}
    body["user"] = "u" * (MAX_BODY_BYTES - len(_j(body)))
    raw = _j(body)
    assert len(raw) == MAX_BODY_BYTES and len(base) < len(raw)
    async with http.post(
        rr.url + C, data=raw, headers={"Content-Type": "application/json"}
    ) as resp:
        assert resp.status == 200, await resp.read()


async def test_body_of_many_chunks_is_read_whole(
    sims: Sims, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    """A 3 MB body (JSON whitespace around a short prompt) reaches the router in many socket
    reads; it is served, not cut at the first read and refused as invalid JSON."""
    router = await start_router(
        [{"id": "p0", "url": sims.prefill.url, "role": "prefill"},
         {"id": "d0", "url": sims.decode.url, "role": "decode"}],
        recovery={"eject_after": 100},
    )  # fmt: skip
    raw = _j({"model": MODEL, "prompt": "ab " * 10, "max_tokens": 2})
    padded = raw[:-1] + b" " * 3_000_000 + b"}"
    async with http.post(
        router.url + C, data=padded, headers={"Content-Type": "application/json"}
    ) as resp:
        assert resp.status == 200, await resp.read()


# ------------------------------------------------------------------- token counting


async def _learned_limit(rr: RunningRouter) -> None:
    """The router learns max_model_len from /v1/models on its first health sweeps."""
    await eventually(
        lambda: all(e["max_model_len"] == MAX_MODEL_LEN for e in rr.router.engines_json()),
        timeout_s=5,
        what="max_model_len learned",
    )


def _words(n: int) -> str:
    return " ".join(f"w{i}" for i in range(n))  # the sim counts one token per word


TOO_LONG = [
    ("prompt", C, {"prompt": _words(100)}),
    ("prompt-plus-max-tokens", C, {"prompt": _words(40), "max_tokens": 30}),
    ("token-ids", C, {"prompt": list(range(1, 71))}),
    ("nested-token-ids", C, {"prompt": [list(range(1, 66))]}),
    ("chat", CHAT, {"messages": [{"role": "user", "content": _words(80)}]}),
    ("chat-max-completion-tokens", CHAT,
     {"messages": [{"role": "user", "content": _words(30)}], "max_completion_tokens": 40}),
]  # fmt: skip


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize(("path", "body"), [pytest.param(*c[1:], id=c[0]) for c in TOO_LONG])
async def test_prompt_longer_than_the_model_is_400_before_any_engine(
    rr: RunningRouter,
    sims: Sims,
    http: aiohttp.ClientSession,
    path: str,
    body: dict[str, Any],
    stream: bool,
) -> None:
    await _learned_limit(rr)
    async with http.post(rr.url + path, json={"model": MODEL, **body, "stream": stream}) as resp:
        error = _assert_error_shape(resp.status, resp.content_type, await resp.read(), 400)
    assert "maximum context length" in error["message"]
    assert sims.prefill.requests() == [] and sims.decode.requests() == []
    assert _total(await _samples(http, rr), "narwhal_engine_failures_total") == 0


async def test_prompt_that_fits_only_by_count_is_served(
    rr: RunningRouter, sims: Sims, http: aiohttp.ClientSession
) -> None:
    """40 words take 40 tokens: more bytes than the model's length, but they fit."""
    await _learned_limit(rr)
    prompt = _words(40)
    assert len(prompt.encode()) > MAX_MODEL_LEN
    for _ in range(2):  # the second time the count comes from the router's cache
        async with http.post(
            rr.url + C, json={"model": MODEL, "prompt": prompt, "max_tokens": 8}
        ) as resp:
            answer = await resp.json()
            assert resp.status == 200, answer
        assert len(answer["choices"][0]["text"].split()) == 8
    assert [r["leg"] for r in sims.decode.requests()] == ["decode", "decode"]
    results = {
        s.labels["result"]: s.value
        for s in await _samples(http, rr)
        if s.name == "narwhal_token_checks_total"
    }
    assert results.get("counted") == 1 and results.get("cached") == 1


async def test_token_counting_uses_the_data_pool_not_the_control_pool(
    sims: Sims, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    """Spec: "Prefill, decode, and token counting use the data connection pool". With the only
    control connection held, a prompt that needs a real /tokenize count is still counted and
    served at once (on the control pool it would wait out the first-token timeout)."""
    first_token_timeout_s = 8.0
    rr = await start_router(
        [{"id": "p0", "url": sims.prefill.url, "role": "prefill"},
         {"id": "d0", "url": sims.decode.url, "role": "decode"}],
        engine={"control_connections": 1},
        serving={"first_token_timeout_s": first_token_timeout_s},
        recovery={"eject_after": 100},
    )  # fmt: skip
    await _learned_limit(rr)
    prompt = _words(40)
    assert len(prompt.encode()) > MAX_MODEL_LEN  # so the bound does not suffice: it is counted
    client = rr.router.client
    async with client.control_slot(first_token_timeout_s):
        assert client.control_in_use == 1
        started = time.monotonic()
        async with http.post(
            rr.url + C, json={"model": MODEL, "prompt": prompt, "max_tokens": 4}
        ) as resp:
            answer = await resp.json()
        elapsed = time.monotonic() - started
        assert resp.status == 200, answer
        assert client.control_in_use == 1  # still ours: nothing else got a control connection
    assert elapsed < first_token_timeout_s / 2, elapsed
    assert [r["leg"] for r in sims.decode.requests()] == ["decode"]
    results = {
        s.labels["result"]: s.value
        for s in await _samples(http, rr)
        if s.name == "narwhal_token_checks_total"
    }
    assert results.get("counted") == 1, results
