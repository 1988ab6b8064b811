"""`/v1/embeddings` in front of a real engine: llama.cpp's `llama-server --embeddings` (mean
pooling over Gemma 3 270M) as a `role: embed` engine. The router passes the body as it is,
so the vectors are the engine's, byte for byte; the engine is verified and, once killed,
classified and out of `/ready`."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from tests.support.llama import MODEL_ALIAS, LlamaBinaries, LlamaServer
from tests.support.poll import eventually
from tests.support.router import StartRouter

pytestmark = [pytest.mark.llama, pytest.mark.slow]


@pytest.fixture
def embedder(bins: LlamaBinaries, slot_dir: Path) -> Iterator[LlamaServer]:
    server = LlamaServer(
        bins, slot_dir, parallel=1, swa_full=False, extra_args=("--embeddings", "--pooling", "mean")
    )
    try:
        yield server.start()
    finally:
        server.stop()


async def test_embeddings_from_a_real_engine_pass_through_unchanged(
    embedder: LlamaServer, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    engine = {"id": "e0", "url": embedder.url, "role": "embed", "api": "llamacpp"}
    rr = await start_router([engine], recovery={"eject_after": 1})

    async def ready() -> bool:
        async with http.get(rr.url + "/ready") as resp:
            return resp.status == 200

    await eventually(ready, timeout_s=20, what="the embed engine verified")
    body: dict[str, Any] = {"model": MODEL_ALIAS, "input": ["hello world", "narwhal"]}
    async with http.post(embedder.url + "/v1/embeddings", json=body) as resp:
        direct = await resp.json()
    async with openai.AsyncOpenAI(base_url=rr.url + "/v1", api_key="k", max_retries=0) as c:
        got = await c.embeddings.create(encoding_format="float", **body)
        with pytest.raises(openai.BadRequestError) as refused:
            await c.completions.create(model=MODEL_ALIAS, prompt="hi", max_tokens=2)
    assert [d.embedding for d in got.data] == [d["embedding"] for d in direct["data"]]
    assert len(got.data[0].embedding) > 100 and got.data[0].embedding != got.data[1].embedding
    assert got.usage.prompt_tokens == direct["usage"]["prompt_tokens"]
    assert refused.value.code == "model_not_supported"

    embedder.kill()
    async with http.post(rr.url + "/v1/embeddings", json=body) as resp:
        assert resp.status == 502, await resp.text()

    async def unready() -> str | None:
        async with http.get(rr.url + "/ready") as resp:
            return await resp.text() if resp.status == 503 else None

    assert await eventually(unready, timeout_s=10, what="/ready 503") == "no capacity: embed"
    async with http.get(rr.url + "/admin/engines") as resp:
        [state] = (await resp.json())["engines"]
    assert state["ejected"] and state["ejection"]["cause"] == "connection"
