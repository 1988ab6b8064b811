"""Several models behind one router (DESIGN §10, issue 19): each engine serves one model (its
`model`, else the config's), and a request goes to the engines of the model it names.

Real `narwhal-sim` engines: a prefill and a decode serving `model-a` (the default), a prefill
and a decode serving `model-b`, and one engine declared `model-b` that serves `model-a`, which
therefore never takes work. Through the official `openai` client: each model's requests reach
only its engines, an unknown model is a 404 `model_not_found`, `/v1/models` lists the models
that can be served, and a model without capacity is refused (503) and named by `/ready`
while the other model serves on.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import aiohttp
import openai
import pytest

from tests.support.poll import eventually
from tests.support.router import RunningRouter, StartRouter
from tests.support.sim_process import SimFactory, SimProcess

pytestmark = pytest.mark.slow


@pytest.fixture
def sims() -> Iterator[dict[str, SimProcess]]:
    factory = SimFactory()
    roles = {"prefill": "kv_producer", "decode": "kv_consumer"}
    specs = {
        "pa": ("prefill", "model-a"),
        "da": ("decode", "model-a"),
        "pb": ("prefill", "model-b", "--lora", "b-sql"),
        "db": ("decode", "model-b", "--lora", "b-sql"),
        "dx": ("decode", "model-a"),  # declared model-b below: the wrong model
    }
    try:
        started = factory.start_many(
            [
                ["--role", r, "--kv-role", roles[r], "--model", m, *lora]
                for r, m, *lora in specs.values()
            ]
        )
        yield dict(zip(specs, started, strict=True))
    finally:
        factory.close()


async def _router(start_router: StartRouter, sims: dict[str, SimProcess]) -> RunningRouter:
    engines: list[dict[str, Any]] = [
        {"id": "pa", "url": sims["pa"].url, "role": "prefill"},
        {"id": "da", "url": sims["da"].url, "role": "decode"},
        {"id": "pb", "url": sims["pb"].url, "role": "prefill", "model": "model-b"},
        {"id": "db", "url": sims["db"].url, "role": "decode", "model": "model-b"},
        {"id": "dx", "url": sims["dx"].url, "role": "decode", "model": "model-b"},
    ]
    rr = await start_router(engines, model="model-a", controller={"monitor_interval_s": 0.1})

    async def ready() -> bool:
        async with aiohttp.ClientSession() as http, http.get(rr.url + "/ready") as resp:
            return resp.status == 200

    await eventually(ready, timeout_s=10, what="both models ready")
    return rr


def _completions(sim: SimProcess) -> list[dict[str, Any]]:
    return [r for r in sim.requests() if r["path"] == "/v1/completions"]


async def test_each_model_is_served_by_its_own_engines(
    sims: dict[str, SimProcess], start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    rr = await _router(start_router, sims)
    async with openai.AsyncOpenAI(base_url=rr.url + "/v1", api_key="k", max_retries=0) as client:
        listed = await client.models.list()
        assert sorted(m.id for m in listed.data) == ["b-sql", "model-a", "model-b"]
        for sim in sims.values():
            sim.clear_requests()
        for _ in range(3):
            a = await client.completions.create(model="model-a", prompt="to a", max_tokens=4)
            b = await client.completions.create(model="model-b", prompt="to b", max_tokens=4)
            assert (a.model, b.model) == ("model-a", "model-b")
        chat = await client.chat.completions.create(
            model="model-b", messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
        assert chat.model == "model-b"
        # A LoRA adapter that model-b's engines list under its own name: routed to them.
        lora = await client.completions.create(model="b-sql", prompt="to b's adapter", max_tokens=2)
        assert lora.model == "b-sql"
        with pytest.raises(openai.NotFoundError) as missing:
            await client.completions.create(model="model-c", prompt="x", max_tokens=2)
    assert missing.value.code == "model_not_found"

    bodies = {name: [r["body"]["model"] for r in _completions(s)] for name, s in sims.items()}
    assert set(bodies["pa"]) == set(bodies["da"]) == {"model-a"} and len(bodies["da"]) == 3
    assert set(bodies["pb"]) == {"model-b", "b-sql"} and len(bodies["db"]) == 4
    assert bodies["dx"] == []  # declared model-b, serves model-a: never verified
    engines = {
        e["id"]: e for e in (await (await http.get(rr.url + "/admin/engines")).json())["engines"]
    }
    assert engines["dx"]["verified"] is False
    assert "not 'model-b'" in engines["dx"]["unverified_reason"]
    assert (engines["db"]["model"], engines["da"]["model"]) == ("model-b", "model-a")


async def test_a_model_without_capacity_is_refused_while_the_other_serves(
    sims: dict[str, SimProcess], start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    rr = await _router(start_router, sims)
    async with http.post(rr.url + "/admin/engines/db/drain") as resp:
        assert resp.status == 200
    async with http.get(rr.url + "/ready") as resp:
        assert resp.status == 503
        assert await resp.text() == "no capacity: decode (model model-b)"
    async with openai.AsyncOpenAI(base_url=rr.url + "/v1", api_key="k", max_retries=0) as client:
        assert [m.id for m in (await client.models.list()).data] == ["model-a"]  # no b-sql
        with pytest.raises(openai.APIStatusError) as refused:
            await client.completions.create(model="model-b", prompt="x", max_tokens=2)
        assert refused.value.status_code == 503
        served = await client.completions.create(model="model-a", prompt="x", max_tokens=2)
        assert served.model == "model-a"
