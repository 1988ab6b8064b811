"""The OpenAI surface around completions (issue 20 §3), through the official `openai` client
where it has a call for it: batched prompts and `n > 1` are served as one PD request per
choice and merged in order; what disaggregated serving cannot do is refused with a 400 that
names the parameter; `/tokenize` and `/detokenize` pass through to an engine of the model;
`/v1/models` gives each model's `created` and `max_model_len` from its engines.
(`/v1/embeddings`: tests/e2e/test_embeddings.py.)"""

from __future__ import annotations

from typing import Any

import aiohttp
import openai
import pytest

from tests.support.poll import eventually
from tests.support.router import RunningRouter, StartRouter
from tests.support.sim_process import SimFactory, SimProcess

pytestmark = pytest.mark.slow

P = ["--role", "prefill", "--kv-role", "kv_producer"]
D = ["--role", "decode", "--kv-role", "kv_consumer"]


async def _router(
    sim_factory: SimFactory, start_router: StartRouter
) -> tuple[RunningRouter, SimProcess, SimProcess]:
    p0, d0 = sim_factory.start_many([P, D])
    rr = await start_router(
        [
            {"id": "p0", "url": p0.url, "role": "prefill"},
            {"id": "d0", "url": d0.url, "role": "decode"},
        ]
    )
    return rr, p0, d0


def _client(rr: RunningRouter) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=rr.url + "/v1", api_key="k", max_retries=0)


async def test_batched_prompts_with_n_are_one_pd_request_per_choice_merged_in_order(
    sim_factory: SimFactory, start_router: StartRouter
) -> None:
    rr, p0, _ = await _router(sim_factory, start_router)
    args: dict[str, Any] = {"model": "demo-model", "max_tokens": 3}
    async with _client(rr) as c:
        alone = [(await c.completions.create(prompt=p, **args)) for p in ("one two", "three")]
        p0.clear_requests()
        got = await c.completions.create(prompt=["one two", "three"], n=2, seed=5, **args)
        chat = await c.chat.completions.create(
            messages=[{"role": "user", "content": "hi"}], n=2, **args
        )
    texts = [alone[0].choices[0].text] * 2 + [alone[1].choices[0].text] * 2
    assert [(ch.index, ch.text) for ch in got.choices] == list(enumerate(texts))
    assert got.usage is not None
    assert got.usage.prompt_tokens == 2 + 1  # each prompt once, as vLLM counts it
    assert got.usage.completion_tokens == 4 * 3
    # Four prefills: a part is an ordinary PD request (the seed differs per sample).
    prefills = [r["body"] for r in p0.requests() if r["path"] == "/v1/completions"]
    assert sorted((b["prompt"], b["seed"]) for b in prefills[:4]) == [
        ("one two", 5), ("one two", 6), ("three", 5), ("three", 6),
    ]  # fmt: skip
    assert all("n" not in b for b in prefills)
    assert [ch.index for ch in chat.choices] == [0, 1] and chat.choices[1].message.content


async def test_a_prompt_given_as_a_list_of_one_text_is_served_as_that_text(
    sim_factory: SimFactory, start_router: StartRouter
) -> None:
    """`prompt=["..."]` is one prompt, placed by prefix (the default placement) as its text:
    it was taken for token ids there, refused by the key hash, and the request failed."""
    p0, d0 = sim_factory.start_many([P, D])
    engines = [
        {"id": "p0", "url": p0.url, "role": "prefill"},
        {"id": "d0", "url": d0.url, "role": "decode"},
    ]
    rr = await start_router(engines, placement={"policy": "prefix"})
    args: dict[str, Any] = {"model": "demo-model", "max_tokens": 3, "seed": 1}
    async with _client(rr) as c:
        alone = await c.completions.create(prompt="one two three", **args)
        listed = await c.completions.create(prompt=["one two three"], **args)
    assert [ch.text for ch in listed.choices] == [ch.text for ch in alone.choices]
    assert listed.usage is not None and listed.usage.prompt_tokens == 3


async def test_with_one_data_connection_the_parts_take_turns(
    sim_factory: SimFactory, start_router: StartRouter
) -> None:
    """Each part in flight holds a data connection: with one, a batch runs part by part."""
    p0, d0 = sim_factory.start_many([P, D])
    engines = [
        {"id": "p0", "url": p0.url, "role": "prefill"},
        {"id": "d0", "url": d0.url, "role": "decode"},
    ]
    rr = await start_router(engines, serving={"max_connections": 1})
    async with _client(rr) as c:
        got = await c.completions.create(model="demo-model", prompt=["a", "b", "c"], max_tokens=2)
    assert [ch.index for ch in got.choices] == [0, 1, 2]
    assert all(ch.text for ch in got.choices)


async def test_the_first_failed_part_is_the_answer(
    sim_factory: SimFactory, start_router: StartRouter
) -> None:
    rr, _, d0 = await _router(sim_factory, start_router)
    d0.add_fault({"kind": "completion_status", "status": 500, "count": 1, "leg": "decode"})
    async with _client(rr) as c:
        with pytest.raises(openai.APIStatusError) as failed:
            await c.completions.create(model="demo-model", prompt=["a", "b"], max_tokens=2)
    assert failed.value.status_code == 502


@pytest.mark.parametrize(
    ("call", "param"),
    [
        ({"n": 2, "stream": True}, "n"),
        ({"prompt": ["one", "two"], "stream": True}, "prompt"),
        ({"echo": True, "logprobs": 1}, "echo"),
        ({"extra_body": {"prompt_logprobs": 1}}, "prompt_logprobs"),
    ],
    ids=["n-streamed", "batched-streamed", "echo-logprobs", "prompt-logprobs"],
)
async def test_what_pd_cannot_do_is_a_400_naming_the_parameter(
    call: dict[str, Any], param: str, sim_factory: SimFactory, start_router: StartRouter
) -> None:
    rr, _, _ = await _router(sim_factory, start_router)
    args = {"model": "demo-model", "prompt": "hello", "max_tokens": 2, **call}
    async with _client(rr) as c:
        with pytest.raises(openai.BadRequestError) as refused:
            await c.completions.create(**args)
    assert refused.value.param == param


async def test_tokenize_and_detokenize_pass_through_to_an_engine_of_the_model(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    rr, _, _ = await _router(sim_factory, start_router)
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
    rr, _, _ = await _router(sim_factory, start_router)

    async def learned() -> bool:  # the health stage reads each engine's generation
        return all(e.generation is not None for e in rr.router.fleet)

    await eventually(learned, timeout_s=10, what="engine generations")
    async with _client(rr) as c:
        (model,) = (await c.models.list()).data
    starts = [e.generation for e in rr.router.fleet if e.generation is not None]
    assert model.id == "demo-model" and model.created == int(min(starts)) > 0
    assert model.model_extra is not None and model.model_extra["max_model_len"] == 4096
