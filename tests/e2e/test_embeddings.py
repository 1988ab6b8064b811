"""`/v1/embeddings` (issue 20 §3): passed through, with no PD, to the engines that declare it
(`role: embed`), through the official `openai` client. An embed engine is an engine like any
other to the control plane: its failures are classified evidence, an embeddings request is its
inference probe and its readmission's functional step, and `/ready` needs its model's
capacity like any model's."""

from __future__ import annotations

import base64
import struct
from typing import Any

import aiohttp
import openai
import pytest

from narwhal.sim.embeddings import DIMENSIONS, vector
from narwhal.sim.tokens import tokenize
from tests.support.cli import narwhal
from tests.support.poll import eventually
from tests.support.router import RunningRouter, StartRouter
from tests.support.sim_process import SimFactory, SimProcess

pytestmark = pytest.mark.slow

P = ["--role", "prefill", "--kv-role", "kv_producer"]
D = ["--role", "decode", "--kv-role", "kv_consumer"]
# A short context, as embedding models have: it limits their model's prompts, no other's.
E = ["--role", "embed", "--model", "embed-model", "--max-model-len", "64"]


async def _router(
    sim_factory: SimFactory, start_router: StartRouter, **sections: Any
) -> tuple[RunningRouter, list[SimProcess]]:
    """A PD pair for `demo-model` and two embed engines for `embed-model`."""
    p0, d0, e0, e1 = sim_factory.start_many([P, D, E, E])
    rr = await start_router(
        [
            {"id": "p0", "url": p0.url, "role": "prefill"},
            {"id": "d0", "url": d0.url, "role": "decode"},
            {"id": "e0", "url": e0.url, "role": "embed", "model": "embed-model"},
            {"id": "e1", "url": e1.url, "role": "embed", "model": "embed-model"},
        ],
        **sections,
    )
    return rr, [e0, e1]


def _client(rr: RunningRouter) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=rr.url + "/v1", api_key="k", max_retries=0)


async def test_embeddings_pass_through_to_an_embed_engine_in_order(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    rr, embedders = await _router(sim_factory, start_router)
    inputs = ["a b", "c d e", "f"]
    async with _client(rr) as client:
        # The client asks for base64 by default: the vectors come back byte for byte.
        got = await client.embeddings.create(model="embed-model", input=inputs)
        floats = await client.embeddings.create(
            model="embed-model", input="a b", encoding_format="float"
        )
    assert [d.index for d in got.data] == [0, 1, 2]
    for datum, text in zip(got.data, inputs, strict=True):
        expected = vector(tokenize(text), DIMENSIONS)
        packed = struct.pack(f"<{DIMENSIONS}f", *expected)
        assert struct.pack(f"<{DIMENSIONS}f", *datum.embedding) == packed
    assert floats.data[0].embedding == pytest.approx(vector(tokenize("a b"), DIMENSIONS))
    assert got.model == "embed-model" and got.usage.prompt_tokens == 6
    # No PD: one request, to an embed engine, never to the generative pair.
    seen = [r for sim in embedders for r in sim.requests() if r["path"] == "/v1/embeddings"]
    assert len(seen) == 2
    async with http.post(
        rr.url + "/v1/embeddings",
        json={"model": "embed-model", "input": "x", "encoding_format": "base64"},
        headers={"X-Request-Id": "emb-1"},
    ) as resp:
        assert resp.status == 200 and resp.headers["X-Request-Id"] == "emb-1"
        raw = base64.b64decode((await resp.json())["data"][0]["embedding"])
    assert len(raw) == 4 * DIMENSIONS
    async with _client(rr) as client:
        listed = await client.models.list()
    assert sorted(m.id for m in listed.data) == ["demo-model", "embed-model"]


async def test_the_wrong_model_or_input_is_refused_with_its_reason(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    rr, _ = await _router(sim_factory, start_router)
    async with _client(rr) as client:
        with pytest.raises(openai.BadRequestError) as generative:
            await client.embeddings.create(model="demo-model", input="x")
        with pytest.raises(openai.BadRequestError) as embedding:
            await client.completions.create(model="embed-model", prompt="x", max_tokens=2)
        with pytest.raises(openai.NotFoundError) as unknown:
            await client.embeddings.create(model="nope", input="x")
    assert generative.value.code == embedding.value.code == "model_not_supported"
    assert "does not serve embeddings" in generative.value.message
    assert "serves embeddings only" in embedding.value.message
    assert unknown.value.code == "model_not_found"
    for body in ({"model": "embed-model"}, {"model": "embed-model", "input": []}):
        async with http.post(rr.url + "/v1/embeddings", json=body) as resp:
            assert resp.status == 400
            assert (await resp.json())["error"]["param"] == "input"
    # The embed engines' short context is not the generative model's.
    async with _client(rr) as client:
        done = await client.completions.create(
            model="demo-model", prompt=" ".join(["word"] * 100), max_tokens=2
        )
    assert done.usage is not None and done.usage.prompt_tokens == 100
    # What only the engine can judge is its answer, passed on.
    body = {"model": "embed-model", "input": "x", "encoding_format": "int8"}
    async with http.post(rr.url + "/v1/embeddings", json=body) as resp:
        assert resp.status == 400 and "encoding_format" in await resp.text()


async def _engine(http: aiohttp.ClientSession, rr: RunningRouter, engine_id: str) -> Any:
    async with http.get(rr.url + "/admin/engines") as resp:
        return next(e for e in (await resp.json())["engines"] if e["id"] == engine_id)


async def test_a_failing_embed_engine_is_ejected_retried_around_and_readmitted_after_checks(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    """An embed engine that keeps answering 500 is charged `inference_status`, held, and
    ejected when its probe fails too; the request is retried on the other (bounded).
    Readmission verifies it with an embeddings request in place of a KV transfer."""
    rr, (_, e1) = await _router(
        sim_factory, start_router, serving={"policy": "bounded"}, recovery={"eject_after": 1}
    )
    e1.add_fault({"kind": "completion_status", "status": 500})
    async with _client(rr) as client:
        for _ in range(2):  # the least busy first, ties in rotation: e1 is tried once
            got = await client.embeddings.create(model="embed-model", input="retry me")
            assert len(got.data) == 1

    async def ejected() -> Any:
        state = await _engine(http, rr, "e1")
        return state if state["ejected"] else None

    state = await eventually(ejected, timeout_s=5, what="e1 ejected")
    assert state["ejection"]["cause"] == "inference_status"
    e1.clear_faults()
    async with http.post(rr.url + "/admin/engines/e1/readmit") as resp:
        answer = await resp.json()
    assert answer["readmitted"] is True, answer
    step = next(s for s in answer["steps"] if s["step"] == "kv_transfer")
    assert step["reason"] == "transfers no KV (embed engine); answered an embeddings request"
    assert any(r["path"] == "/v1/embeddings" for r in e1.requests())


async def test_an_embed_engines_inference_probe_is_an_embeddings_request(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    """A 500 (with `eject_after: 1`) holds the engine for inference verification; its probe
    is an embeddings request, which passes (the fault fired once) and clears the hold."""
    rr, (e0, e1) = await _router(sim_factory, start_router, recovery={"eject_after": 1})
    for sim in (e0, e1):
        sim.add_fault({"kind": "completion_status", "status": 500, "count": 1})
    async with _client(rr) as client:
        with pytest.raises(openai.InternalServerError):
            await client.embeddings.create(model="embed-model", input="x")
    failed = next(i for i, sim in enumerate((e0, e1)) if sim.requests())
    sim = (e0, e1)[failed]

    async def probed() -> list[Any] | None:
        state = await _engine(http, rr, f"e{failed}")
        probes = [
            r for r in sim.requests()
            if r["headers"].get("x-request-id", "").startswith("narwhal-probe-")
        ]  # fmt: skip
        return probes if probes and not state["holds"] and not state["ejected"] else None

    [probe] = await eventually(probed, timeout_s=5, what="the hold cleared by a probe")
    assert probe["path"] == "/v1/embeddings"
    assert probe["body"] == {"model": "embed-model", "input": "narwhal inference probe"}


async def test_ready_needs_the_embed_models_capacity(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    rr, embedders = await _router(sim_factory, start_router, recovery={"eject_after": 1})
    for sim in embedders:
        sim.kill()

    async def unready() -> str | None:
        async with http.get(rr.url + "/ready") as resp:
            text = await resp.text()
            return text if resp.status == 503 else None

    reason = await eventually(unready, timeout_s=10, what="/ready 503")
    assert reason == "no capacity: embed (model embed-model)"
    async with _client(rr) as client:
        with pytest.raises(openai.APIStatusError) as refused:
            await client.embeddings.create(model="embed-model", input="x")
        assert refused.value.status_code == 503
        # The generative model is served meanwhile.
        done = await client.completions.create(model="demo-model", prompt="hi", max_tokens=2)
        assert done.choices[0].text


async def test_an_embed_engine_joins_at_runtime_and_never_serves_a_generative_model(
    sim_factory: SimFactory, start_router: StartRouter
) -> None:
    rr, _ = await _router(sim_factory, start_router)
    e2 = sim_factory(*E)
    cli = await narwhal(
        "--url", rr.url, "engines", "add", "e2", e2.url, "--role", "embed",
        "--model", "embed-model", "--timeout-s", "10",
    )  # fmt: skip
    assert cli.code == 0, cli.err
    assert cli.out.splitlines()[-1] == "e2: in service"
    stray = sim_factory(*E)
    cli = await narwhal(
        "--url", rr.url, "engines", "add", "e3", stray.url, "--role", "embed", "--no-wait"
    )
    assert cli.code == 1
    assert "model 'demo-model' is served by generative engines already" in cli.err
