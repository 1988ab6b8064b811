"""The llamacpp adapter end to end, against real `llama-server` processes (issue 11).

A prefill server and a decode server share one `--slot-save-path`; Narwhal runs the prefill
with one token in a slot, saves the slot to a file, restores it into a slot of the decode
server and continues the request there. Checked: the PD answer equals a unified run at
temperature 0 and the decode evaluated only the last prompt token; streaming through the
official `openai` client; slot files are removed; a handoff the decode server cannot read
(missing file, or silently recomputed without `--swa-full`) is a `kv_handoff` failure of the
prefill engine; a decode server with no free slot is the router's saturation (503), not
evidence against it; a killed server is ejected and readmitted with a newer generation.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.llama import LlamaBinaries, LlamaServer
from tests.support.poll import eventually
from tests.support.router import RunningRouter, StartRouter

pytestmark = pytest.mark.llama

PROMPT = "Once upon a time in a land far away there lived a"
SECTIONS: dict[str, Any] = {
    "serving": {"request_timeout_s": 60, "first_token_timeout_s": 30, "stream_idle_timeout_s": 30},
    "engine": {"health_timeout_s": 2.0, "probe_timeout_s": 30.0},
    "controller": {"monitor_interval_s": 0.2},
}


@pytest.fixture(scope="module")
def servers(bins: LlamaBinaries, slot_dir: Path) -> Iterator[dict[str, LlamaServer]]:
    """A prefill and a decode server sharing `slot_dir`, and a unified one."""
    started: dict[str, LlamaServer] = {}
    try:
        for name in ("prefill", "decode", "unified"):
            started[name] = LlamaServer(bins, slot_dir).start()
        yield started
    finally:
        for server in started.values():
            server.stop()


def engine(engine_id: str, server: LlamaServer, role: str, slot_dir: Path | None) -> dict[str, Any]:
    spec: dict[str, Any] = {"id": engine_id, "url": server.url, "role": role, "api": "llamacpp"}
    if slot_dir is not None:
        spec["slot_save_path"] = str(slot_dir)
    return spec


async def complete(http: aiohttp.ClientSession, rr: RunningRouter, **body: Any) -> Any:
    payload = {"model": "demo-model", "temperature": 0, **body}
    async with http.post(rr.url + "/v1/completions", json=payload) as resp:
        return resp.status, await resp.json()


async def leg_outcome(http: aiohttp.ClientSession, rr: RunningRouter, **labels: str) -> float:
    async with http.get(rr.url + "/metrics") as resp:
        text = await resp.text()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "narwhal_leg_outcomes_total" and all(
                sample.labels.get(k) == v for k, v in labels.items()
            ):
                return float(sample.value)
    return 0.0


async def slot_files_removed(slot_dir: Path) -> None:
    """Every slot file was used once and removed (the names say which request left one)."""
    try:
        await eventually(lambda: not any(slot_dir.iterdir()), timeout_s=5, what="no slot files")
    except AssertionError:
        left = sorted(await asyncio.to_thread(os.listdir, slot_dir))
        raise AssertionError(f"slot files left: {left}") from None


async def pd_router(
    start_router: StartRouter,
    prefill: LlamaServer,
    decode: LlamaServer,
    slot_dir: Path,
    **sections: Any,
) -> RunningRouter:
    """A ready router with p1 on `prefill` and d1 on `decode`, both told `slot_dir`."""
    rr = await start_router(
        [
            engine("p1", prefill, "prefill", slot_dir),
            engine("d1", decode, "decode", slot_dir),
        ],
        **{**SECTIONS, **sections},
    )
    await eventually(lambda: rr.router.ready() is None, timeout_s=10, what="router ready")
    return rr


async def test_pd_split_equals_unified_and_decode_evaluates_only_the_last_prompt_token(
    start_router: StartRouter,
    servers: dict[str, LlamaServer],
    slot_dir: Path,
    http: aiohttp.ClientSession,
) -> None:
    pd = await pd_router(start_router, servers["prefill"], servers["decode"], slot_dir)
    unified = await start_router([engine("u1", servers["unified"], "both", None)], **SECTIONS)

    status, split = await complete(http, pd, prompt=PROMPT, max_tokens=16)
    assert status == 200, split
    status, whole = await complete(http, unified, prompt=PROMPT, max_tokens=16)
    assert status == 200, whole

    assert split["choices"][0]["text"] == whole["choices"][0]["text"]
    assert split["choices"][0]["text"].strip()
    prompt_tokens = split["usage"]["prompt_tokens"]
    assert prompt_tokens > 5
    # The decode server restored the saved slot and evaluated only the last prompt token;
    # the unified server evaluated the whole prompt.
    assert split["timings"]["prompt_n"] == 1
    assert split["timings"]["cache_n"] == prompt_tokens - 1
    assert whole["timings"]["prompt_n"] + whole["timings"]["cache_n"] == prompt_tokens
    assert await leg_outcome(http, pd, engine="p1", leg="prefill", outcome="kv_handoff") == 0
    # The slot file was used once and removed.
    await slot_files_removed(slot_dir)


async def test_streaming_through_the_openai_client(
    start_router: StartRouter, servers: dict[str, LlamaServer], slot_dir: Path
) -> None:
    rr = await pd_router(start_router, servers["prefill"], servers["decode"], slot_dir)
    unified = await start_router([engine("u1", servers["unified"], "both", None)], **SECTIONS)
    client = openai.AsyncOpenAI(base_url=rr.url + "/v1", api_key="unused", max_retries=0)
    direct = openai.AsyncOpenAI(base_url=unified.url + "/v1", api_key="unused", max_retries=0)
    messages: Any = [{"role": "user", "content": "Name three colours."}]
    try:
        stream = await client.completions.create(
            model="demo-model", prompt=PROMPT, max_tokens=12, temperature=0, stream=True
        )
        pieces = [c.choices[0].text async for c in stream if c.choices]
        whole = await direct.completions.create(
            model="demo-model", prompt=PROMPT, max_tokens=12, temperature=0
        )
        chat = await client.chat.completions.create(
            model="demo-model", messages=messages, max_tokens=8, temperature=0, stream=True
        )
        chunks = [c async for c in chat]
    finally:
        await client.close()
        await direct.close()
    assert len(pieces) > 1
    assert "".join(pieces) == whole.choices[0].text
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content.strip()
    assert chunks[-1].choices[0].finish_reason == "length"
    await slot_files_removed(slot_dir)


async def test_missing_slot_file_is_a_kv_handoff_failure_of_the_prefill_engine(
    start_router: StartRouter,
    servers: dict[str, LlamaServer],
    bins: LlamaBinaries,
    slot_dir: Path,
    tmp_path: Path,
    http: aiohttp.ClientSession,
) -> None:
    # This decode server looks for slot files in another directory: every file the prefill
    # saved is missing there, and its restore answers 400.
    elsewhere = LlamaServer(bins, tmp_path / "other-slots").start()
    try:
        rr = await pd_router(start_router, servers["prefill"], elsewhere, slot_dir)
        status, body = await complete(http, rr, prompt=PROMPT, max_tokens=4)
        assert status == 502, body
        assert "kv_handoff" in body["error"]["message"]
        assert "slot restore refused" in body["error"]["message"]
        assert await leg_outcome(http, rr, engine="p1", leg="prefill", outcome="kv_handoff") == 1
        assert await leg_outcome(http, rr, engine="d1", leg="decode", outcome="connection") == 0
        # The unusable file was still removed from the shared directory.
        await slot_files_removed(slot_dir)
    finally:
        elsewhere.stop()


async def test_a_silently_recomputed_handoff_is_a_kv_handoff_failure(
    start_router: StartRouter,
    servers: dict[str, LlamaServer],
    bins: LlamaBinaries,
    slot_dir: Path,
    http: aiohttp.ClientSession,
) -> None:
    # Without --swa-full the restore reports success but the server recomputes the prompt.
    no_swa = LlamaServer(bins, slot_dir, swa_full=False).start()
    try:
        rr = await pd_router(start_router, servers["prefill"], no_swa, slot_dir)
        status, body = await complete(http, rr, prompt=PROMPT, max_tokens=4)
        assert status == 200, body  # the answer itself is right: the prompt was recomputed
        assert body["timings"]["prompt_n"] == body["usage"]["prompt_tokens"]
        assert await leg_outcome(http, rr, engine="p1", leg="prefill", outcome="kv_handoff") == 1
        assert await leg_outcome(http, rr, engine="d1", leg="decode", outcome="decode_done") == 1
    finally:
        no_swa.stop()


async def test_a_decode_server_out_of_slots_is_saturation_not_an_engine_failure(
    start_router: StartRouter,
    servers: dict[str, LlamaServer],
    bins: LlamaBinaries,
    slot_dir: Path,
    http: aiohttp.ClientSession,
) -> None:
    # llama.cpp restores a slot file only into a server with the same --parallel and
    # --ctx-size, so this pair runs one slot each.
    prefill = LlamaServer(bins, slot_dir, parallel=1).start()
    one_slot = LlamaServer(bins, slot_dir, parallel=1).start()
    try:
        # The second request waits first_token_timeout_s for d1's slot, then is refused. The
        # long one's 300 tokens take ~10 s on a quiet 2-core host, up to 4x that beside a CPU
        # hog: the request deadline leaves room for that, and 2 s for its slot restore.
        serving = {**SECTIONS["serving"], "first_token_timeout_s": 2.0, "request_timeout_s": 180}
        rr = await pd_router(start_router, prefill, one_slot, slot_dir, serving=serving)
        long = asyncio.create_task(
            complete(http, rr, prompt=PROMPT, max_tokens=300, ignore_eos=True)
        )
        await eventually(
            lambda: rr.router.fleet.in_flight.of("d1") == 1 or long.done(),
            timeout_s=20,
            what="d1's one slot taken",
        )
        assert not long.done(), long.result()
        async with http.post(
            rr.url + "/v1/completions",
            json={"model": "demo-model", "prompt": PROMPT, "max_tokens": 4},
        ) as resp:
            assert resp.status == 503
            assert resp.headers["Retry-After"] == "1"
            assert "no free slot on d1" in (await resp.json())["error"]["message"]
        assert not long.done()
        status, body = await long
        assert status == 200, body
        # Waiting for a slot is the router's saturation, never evidence against the engine.
        d1 = rr.router.fleet.get("d1")
        assert d1.ejected is None and not d1.active_holds_by_name(rr.router.clock.monotonic())
        for outcome in ("timeout", "overload", "connection", "inference_status"):
            assert await leg_outcome(http, rr, engine="d1", outcome=outcome) == 0
    finally:
        prefill.stop()
        one_slot.stop()


@pytest.mark.slow
async def test_killed_server_is_ejected_and_readmitted_after_restart_with_a_newer_generation(
    start_router: StartRouter,
    servers: dict[str, LlamaServer],
    bins: LlamaBinaries,
    slot_dir: Path,
    http: aiohttp.ClientSession,
) -> None:
    decode = LlamaServer(bins, slot_dir).start()
    try:
        rr = await start_router(
            [
                engine("p1", servers["prefill"], "prefill", slot_dir),
                engine("d1", decode, "decode", slot_dir),
            ],
            **SECTIONS,
        )
        fleet = rr.router.fleet
        await eventually(lambda: fleet.get("d1").generation, timeout_s=10, what="generation")
        before = fleet.get("d1").generation
        assert before is not None

        decode.kill()
        await eventually(lambda: fleet.get("d1").ejected, timeout_s=20, what="d1 ejected")
        status, body = await complete(http, rr, prompt=PROMPT, max_tokens=4)
        assert status == 503, body  # no decode capacity: the prefill is not spent

        decode.start()
        await eventually(
            lambda: fleet.get("d1").ejected is None, timeout_s=60, what="d1 readmitted"
        )
        after = fleet.get("d1").generation
        assert after is not None and after > before
        steps = {r.step: r.ok for r in rr.router.readmission.last_results["d1"]}
        assert steps["generation_identity"] and steps["kv_transfer"]
        status, body = await complete(http, rr, prompt=PROMPT, max_tokens=4)
        assert status == 200, body
        assert body["timings"]["prompt_n"] == 1
    finally:
        decode.stop()
