"""The OpenAI surface around completions (issue 20 §3), through the official `openai` client
where it has a call for it: what disaggregated serving cannot do is refused with a 400 that
names the parameter; `/tokenize` and `/detokenize` pass through to an engine of the model;
`/v1/models` gives each model's `created` and `max_model_len` from its engines."""

from __future__ import annotations

from typing import Any

import aiohttp
import openai
import pytest

from tests.support.poll import eventually
from tests.support.router import RunningRouter, StartRouter
from tests.support.sim_process import SimFactory

pytestmark = pytest.mark.slow

P = ["--role", "prefill", "--kv-role", "kv_producer"]
D = ["--role", "decode", "--kv-role", "kv_consumer"]


async def _router(sim_factory: SimFactory, start_router: StartRouter) -> RunningRouter:
    p0, d0 = sim_factory.start_many([P, D])
    return await start_router(
        [
            {"id": "p0", "url": p0.url, "role": "prefill"},
            {"id": "d0", "url": d0.url, "role": "decode"},
        ]
    )


@pytest.mark.parametrize(
    ("call", "param"),
    [
        ({"n": 2}, "n"),
        ({"prompt": ["one", "two"]}, "prompt"),
        ({"echo": True, "logprobs": 1}, "echo"),
        ({"extra_body": {"prompt_logprobs": 1}}, "prompt_logprobs"),
    ],
    ids=["n", "batched", "echo-logprobs", "prompt-logprobs"],
)
async def test_what_pd_cannot_do_is_a_400_naming_the_parameter(
    call: dict[str, Any], param: str, sim_factory: SimFactory, start_router: StartRouter
) -> None:
    rr = await _router(sim_factory, start_router)
    args = {"model": "demo-model", "prompt": "hello", "max_tokens": 2, **call}
    async with openai.AsyncOpenAI(base_url=rr.url + "/v1", api_key="k", max_retries=0) as c:
        with pytest.raises(openai.BadRequestError) as refused:
            await c.completions.create(**args)
    assert refused.value.param == param


async def test_tokenize_and_detokenize_pass_through_to_an_engine_of_the_model(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    rr = await _router(sim_factory, start_router)
    body = {"model": "demo-model", "prompt": "three little words"}
    async with http.post(rr.url + "/tokenize", json=body) as resp:
        assert resp.status == 200, await resp.text()
        tokens = (await resp.json())["tokens"]
        assert len(tokens) == 3 and resp.headers.get("Content-Type", "").startswith(
            "application/json"
        )
    async with http.post(
        rr.url + "/detokenize", json={"model": "demo-model", "tokens": tokens}
    ) as resp:
        assert resp.status == 200
        assert (await resp.json())["prompt"].count("<") == 3
    async with http.post(rr.url + "/tokenize", json={**body, "model": "other"}) as resp:
        assert resp.status == 404
        assert (await resp.json())["error"]["code"] == "model_not_found"
    async with http.post(rr.url + "/tokenize", data=b"{") as resp:
        assert resp.status == 400


async def test_models_give_created_and_max_model_len_from_the_engines(
    sim_factory: SimFactory, start_router: StartRouter
) -> None:
    rr = await _router(sim_factory, start_router)

    async def learned() -> bool:  # the health stage reads each engine's generation
        return all(e.generation is not None for e in rr.router.fleet)

    await eventually(learned, timeout_s=10, what="engine generations")
    async with openai.AsyncOpenAI(base_url=rr.url + "/v1", api_key="k", max_retries=0) as c:
        (model,) = (await c.models.list()).data
    starts = [e.generation for e in rr.router.fleet if e.generation is not None]
    assert model.id == "demo-model" and model.created == int(min(starts)) > 0
    assert model.model_extra is not None and model.model_extra["max_model_len"] == 4096
