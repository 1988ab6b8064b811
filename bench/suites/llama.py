"""Time to first token on real llama-server processes, with and without the PD split.

One prefill and one decode `llama-server` (sharing a slot directory, `--swa-full`) behind
Narwhal (`narwhal-pd`), and a third server that serves whole requests, measured directly
(`direct`) and behind Narwhal (`narwhal-unified`). Every request streams a long prompt with a
unique head, so no server can reuse a cached prefix, and asks for a few tokens. Requests run
one at a time, rotating over the targets, so the three are measured side by side under the
same machine load. TTFT is the time to the first event with text; the final event's
`timings.prompt_n` shows how many prompt tokens the answering server evaluated. The handoff's
own cost (slot save and restore, as the servers time them) is measured on its own.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import yaml

from bench import web
from bench.context import Context
from bench.procs import Proc, free_port, spawn

REPO = Path(__file__).resolve().parents[2]
MODEL = "demo-model"
TARGETS = ("direct", "narwhal-unified", "narwhal-pd")
_FILLER = (
    "The harbour master counted the boats that came in with the tide, wrote each name in a "
    "ledger, and noted the weather, the catch and the state of the nets. "
)


async def _binaries(ctx: Context) -> dict[str, str]:
    log = (ctx.logs / "get-llama-server.log").open("wb")
    try:
        proc = await asyncio.create_subprocess_exec(
            str(REPO / "scripts" / "get-llama-server.sh"),
            stdout=asyncio.subprocess.PIPE,
            stderr=log,
        )
        out, _ = await proc.communicate()
    finally:
        log.close()
    if proc.returncode != 0:
        raise RuntimeError(f"scripts/get-llama-server.sh failed; see {log.name}")
    lines = out.decode().splitlines()
    return dict(line.split("=", 1) for line in lines if "=" in line)


async def _server(ctx: Context, name: str, bins: dict[str, str], slots: Path) -> tuple[Proc, str]:
    port = free_port()
    argv = [
        bins["LLAMA_SERVER"], "-m", bins["LLAMA_MODEL"], "--host", "127.0.0.1",
        "--port", str(port), "--alias", MODEL, "--slot-save-path", str(slots), "--swa-full",
        "-np", "1", "-c", "4096", "-t", str(ctx.mode.llama_threads),
    ]  # fmt: skip
    proc, _ = await spawn(name, argv, ctx.logs)
    url = f"http://127.0.0.1:{port}"
    await web.wait_until(url + "/health", timeout_s=180, alive=lambda: proc.alive)
    ctx.commands.setdefault("llama-server", " ".join(argv))
    return proc, url


async def _narwhal(ctx: Context, name: str, engines: list[dict[str, Any]]) -> tuple[Proc, str]:
    port = free_port()
    state = ctx.work / "state" / name
    state.mkdir(parents=True, exist_ok=True)
    config = {
        "router_id": f"bench-{name}",
        "listen": f"127.0.0.1:{port}",
        "model": MODEL,
        "engines": engines,
        "serving": {"request_timeout_s": 120, "first_token_timeout_s": 120},
        "engine": {"probe_timeout_s": 60},
        "handoff": {"path": str(state / "handoff.json")},
        "lease": {"backend": "none"},
    }
    path = state / "narwhal.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    argv = [sys.executable, "-m", "narwhal.cli.serve", "--config", str(path)]
    proc, _ = await spawn(name, [*argv, "--log-level", "WARNING"], ctx.logs)
    url = f"http://127.0.0.1:{port}"
    await web.wait_until(url + "/ready", timeout_s=60, alive=lambda: proc.alive)
    ctx.configs.setdefault(name, config)
    return proc, url


def _prompt(i: int, words: int) -> str:
    head = f"Log entry {i}, kept by keeper number {i * 7919 % 10007}. "
    body = (_FILLER * (words // len(_FILLER.split()) + 1)).split()[:words]
    return head + " ".join(body) + " On the last day the keeper wrote"


async def _one(http: aiohttp.ClientSession, url: str, prompt: str, tokens: int) -> dict[str, Any]:
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    ttft: float | None = None
    last: dict[str, Any] = {}
    async with http.post(url + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url}: HTTP {resp.status}: {(await resp.text())[:300]}")
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            event = orjson.loads(line[6:])
            choices = event.get("choices") or []
            if ttft is None and choices and choices[0].get("text"):
                ttft = time.perf_counter() - t0
            if event.get("timings") or event.get("usage"):
                last.update({k: event[k] for k in ("timings", "usage") if event.get(k)})
    total = time.perf_counter() - t0
    timings, usage = last.get("timings", {}), last.get("usage", {})
    return {
        "ttft_ms": None if ttft is None else ttft * 1000,
        "total_ms": total * 1000,
        "prompt_tokens": usage.get("prompt_tokens"),
        "prompt_evaluated": timings.get("prompt_n"),
    }


async def _handoff_cost(
    http: aiohttp.ClientSession, prefill: str, decode: str, slots: Path, prompt: str, i: int
) -> dict[str, Any]:
    """The slot-file handoff on its own: save on the prefill server, restore on the decode's."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "id_slot": 0, "cache_prompt": True}
    async with http.post(prefill + "/v1/completions", json=body) as resp:
        await resp.read()
    name = {"filename": f"bench-handoff-{i}.bin"}
    async with http.post(prefill + "/slots/0?action=save", json=name) as resp:
        saved = await resp.json()
    async with http.post(decode + "/slots/0?action=restore", json=name) as resp:
        restored = await resp.json()
    (slots / name["filename"]).unlink()
    return {
        "save_ms": saved["timings"]["save_ms"],
        "restore_ms": restored["timings"]["restore_ms"],
        "file_mb": saved["n_written"] / 1e6,
        "tokens": saved["n_saved"],
    }


def _summary(samples: list[dict[str, Any]]) -> dict[str, Any]:
    ttft = [s["ttft_ms"] for s in samples if s["ttft_ms"] is not None]
    return {
        "n": len(samples),
        "ttft_ms_median": statistics.median(ttft) if ttft else None,
        "ttft_ms_min": min(ttft, default=None),
        "ttft_ms_max": max(ttft, default=None),
        "total_ms_median": statistics.median(s["total_ms"] for s in samples),
        "prompt_tokens": statistics.median(s["prompt_tokens"] or 0 for s in samples),
        "prompt_evaluated": statistics.median(s["prompt_evaluated"] or 0 for s in samples),
    }


async def run(ctx: Context) -> dict[str, Any]:
    mode = ctx.mode
    bins = await _binaries(ctx)
    slots = ctx.work / "slots"
    slots.mkdir(parents=True, exist_ok=True)
    procs: list[Proc] = []
    try:
        urls: dict[str, str] = {}
        for name in ("llama-prefill", "llama-decode", "llama-unified"):
            proc, urls[name] = await _server(ctx, name, bins, slots)
            procs.append(proc)
        llama = {"api": "llamacpp", "slot_save_path": str(slots)}
        pd_engines = [
            {"id": "p0", "url": urls["llama-prefill"], "role": "prefill", **llama},
            {"id": "d0", "url": urls["llama-decode"], "role": "decode", **llama},
        ]
        unified_engines = [{"id": "u0", "url": urls["llama-unified"], "role": "both", **llama}]
        proc, pd_url = await _narwhal(ctx, "narwhal-pd", pd_engines)
        procs.append(proc)
        proc, unified_url = await _narwhal(ctx, "narwhal-unified", unified_engines)
        procs.append(proc)
        targets = {"direct": urls["llama-unified"], "narwhal-unified": unified_url}
        targets["narwhal-pd"] = pd_url
        samples: dict[str, list[dict[str, Any]]] = {t: [] for t in TARGETS}
        timeout = aiohttp.ClientTimeout(total=300)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            for target in TARGETS:  # warm-up: model pages, first-request allocations
                await _one(http, targets[target], _prompt(10_000, 32), 2)
            for rep in range(mode.llama_reps):
                for j, target in enumerate(TARGETS):
                    prompt = _prompt(rep * len(TARGETS) + j, mode.llama_prompt_words)
                    sample = await _one(http, targets[target], prompt, mode.llama_tokens)
                    samples[target].append(sample)
                ctx.log(f"llama rep {rep + 1}/{mode.llama_reps} done")
            handoffs = [
                await _handoff_cost(
                    http,
                    urls["llama-prefill"],
                    urls["llama-decode"],
                    slots,
                    _prompt(20_000 + i, mode.llama_prompt_words),
                    i,
                )
                for i in range(3)
            ]
        leftover = sorted(p.name for p in slots.iterdir())
    finally:
        for proc in procs:
            await proc.stop()
    return {
        "threads": mode.llama_threads,
        "prompt_words": mode.llama_prompt_words,
        "tokens": mode.llama_tokens,
        "reps": mode.llama_reps,
        "leftover_slot_files": leftover,
        "rows": {t: _summary(s) for t, s in samples.items()},
        "handoff": {k: statistics.median(h[k] for h in handoffs) for k in handoffs[0]},
        "samples": samples,
    }
