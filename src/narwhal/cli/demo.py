"""`narwhal-serve --demo`: a local simulated fleet (2 prefill + 2 decode) and its config, and
a spare decode engine that the banner shows how to add while the router runs.

The engines keep a prefix cache (256 blocks of 16 tokens each) and the router places by it
(`placement.policy: prefix`, by the text's blocks: the demo ships no tokenizer), so the
banner's shared-prefix workload shows the hit rate climb in `narwhal status`."""

from __future__ import annotations

import asyncio
import re
import sys
from contextlib import AsyncExitStack
from typing import Any

from narwhal.config import Config, parse_config

_LISTENING = re.compile(r"listening on (http://\S+)")


async def start_fleet(stack: AsyncExitStack, roles: list[str]) -> list[str]:
    """Start one `narwhal-sim` per role at once, each on an ephemeral port, and return their
    URLs in order. When the stack closes they are all terminated, then all waited for (one
    after another took 0.25 s each on a loaded host, and the demo's stop added them up)."""
    procs: list[asyncio.subprocess.Process] = []

    async def stop() -> None:
        running = [p for p in procs if p.returncode is None]
        for proc in running:
            proc.terminate()
        await asyncio.gather(*(p.wait() for p in running))

    stack.push_async_callback(stop)  # first: a launch that fails stops those before it
    for role in roles:
        procs.append(await _launch(role))
    async with asyncio.timeout(30):
        listening = (_listening(p, r) for p, r in zip(procs, roles, strict=True))
        return list(await asyncio.gather(*listening))


# Smaller than the banner's workload (16 preambles of 400 words, one token per word in the
# sim): one prefill engine cannot hold every preamble, the two together can.
KV_BLOCKS = 256


async def _launch(role: str, *extra: str) -> asyncio.subprocess.Process:
    kv_role = {"prefill": "kv_producer", "decode": "kv_consumer"}[role]
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "narwhal.sim.cli", "serve", "--port", "0",
        "--role", role, "--kv-role", kv_role, "--model", "demo-model",
        "--block-size", "16", "--kv-blocks", str(KV_BLOCKS), *extra,
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip


async def _listening(proc: asyncio.subprocess.Process, role: str) -> str:
    """The URL from the sim's `listening on` line."""
    assert proc.stdout is not None
    while True:
        line = (await proc.stdout.readline()).decode()
        if not line:
            raise RuntimeError(f"narwhal-sim ({role}) exited before listening")
        if match := _LISTENING.search(line):
            return match[1]


def demo_config(prefill_urls: list[str], decode_urls: list[str], listen: str) -> Config:
    engines: list[dict[str, Any]] = [
        {"id": f"p{i}", "url": u, "role": "prefill"} for i, u in enumerate(prefill_urls)
    ] + [{"id": f"d{i}", "url": u, "role": "decode"} for i, u in enumerate(decode_urls)]
    return parse_config(
        {
            "router_id": "demo",
            "listen": listen,
            "model": "demo-model",
            "engines": engines,
            "controller": {"monitor_interval_s": 1.0},
            "placement": {"policy": "prefix"},
            "handoff": {"path": "state/demo-handoff.json"},
        }
    )


def banner(url: str, spare_url: str) -> str:
    return f"""
Narwhal demo: router on {url} in front of 2 prefill + 2 decode narwhal-sim engines.

  curl -s {url}/v1/completions -H 'Content-Type: application/json' \\
       -d '{{"model": "demo-model", "prompt": "Hello narwhal", "max_tokens": 8}}'

  python -c "import openai; c = openai.OpenAI(base_url='{url}/v1', api_key='x'); \\
print(c.chat.completions.create(model='demo-model', max_tokens=8, \\
messages=[{{'role': 'user', 'content': 'Hi'}}]).choices[0].message.content)"

  curl -s {url}/ready ; curl -s {url}/admin/engines ; curl -s {url}/metrics

Requests are placed where their prompt's prefix is cached. A shared-prefix workload (16 long
system prompts, a short question each), then the hit rate:

  narwhal-sim bench --url {url} --workload shared-prefix --duration-s 10
  narwhal status --url {url}

A spare decode engine is running; add it to the live fleet, then remove it:

  narwhal engines add d2 {spare_url} --role decode --url {url}
  narwhal engines remove d2 --url {url}

Ctrl-C stops the router and the engines.
"""
