"""The PD path end to end: the openai client through Narwhal equals a unified run."""

from __future__ import annotations

import asyncio

import openai

from tests.support.router import StartRouter
from tests.support.sim_process import SimFactory


async def test_pd_completion_equals_unified(
    sim_factory: SimFactory, start_router: StartRouter
) -> None:
    prefill, decode, unified = sim_factory.start_many(
        [
            ["--role", "prefill", "--kv-role", "kv_producer"],
            ["--role", "decode", "--kv-role", "kv_consumer"],
            ["--role", "both"],
        ]
    )
    rr = await start_router(
        [
            {"id": "p0", "url": prefill.url, "role": "prefill"},
            {"id": "d0", "url": decode.url, "role": "decode"},
        ]
    )
    client = openai.AsyncOpenAI(base_url=rr.url + "/v1", api_key="x")
    direct = openai.AsyncOpenAI(base_url=unified.url + "/v1", api_key="x")
    prompt = "the quick brown fox jumps over the lazy dog"
    via, ref = await asyncio.gather(
        client.completions.create(model="demo-model", prompt=prompt, max_tokens=12),
        direct.completions.create(model="demo-model", prompt=prompt, max_tokens=12),
    )
    assert via.choices[0].text == ref.choices[0].text
    assert via.usage is not None and via.usage.prompt_tokens_details is not None
    assert via.usage.prompt_tokens_details.cached_tokens == via.usage.prompt_tokens
    await client.close()
    await direct.close()
