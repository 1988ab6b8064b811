"""A profile of Narwhal's hot path: py-spy sampling the router under load.

One prefill and one decode sim (the overhead suite's), Narwhal with its defaults but one
process (`serving.workers: 1`: the request path and the control plane on one loop, which a
profile of one process can show; with workers each runs the same request path), 64 clients,
non-streaming then streaming. py-spy (bench venv) samples the router process without pausing
it (`--nonblocking`) and writes collapsed stacks, aggregated by function; idle samples (the
event loop waiting in epoll) are left out, so shares are of the router's busy time.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from bench.context import Context
from bench.profiles import summarise
from bench.routers import Engines
from bench.sims import SimFleet
from bench.suites.common import measure, run_spec, start_routers
from bench.suites.overhead import FLAGS, MAX_TOKENS, PROMPT_WORDS

RATE_HZ = 200
CONCURRENCY = 64


async def _record(ctx: Context, pid: int, seconds: float, out: Path) -> str | None:
    """Run py-spy for `seconds`; returns an error text or None."""
    proc = await asyncio.create_subprocess_exec(
        str(ctx.venv.bin / "py-spy"),
        "record",
        "--pid",
        str(pid),
        "--duration",
        str(int(seconds)),
        "--rate",
        str(RATE_HZ),
        "--format",
        "raw",
        "--function",
        "--nonblocking",
        "--output",
        str(out),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    text, _ = await proc.communicate()
    if proc.returncode:
        return text.decode(errors="replace")[-500:]
    return None


async def run(ctx: Context) -> dict[str, Any]:
    seconds = ctx.mode.profile_s
    if seconds <= 0:
        return {}
    if not ctx.venv.has("py-spy"):
        return {"error": f"py-spy not installed: {ctx.venv.failed.get('py-spy', 'skipped')}"}
    fleet = SimFleet.plan(1, 1, ctx.model, FLAGS, ctx.logs)
    await fleet.start()
    engines = Engines(
        ctx.model, [s.url for s in fleet.role("prefill")], [s.url for s in fleet.role("decode")]
    )
    profiles: dict[str, Any] = {}
    try:
        router = (await start_routers(ctx, ["narwhal-w1"], engines))["narwhal-w1"]
        assert router.proc is not None
        for stream in ("no", "yes"):
            out = ctx.work / f"profile-narwhal-{'stream' if stream == 'yes' else 'json'}.txt"
            spec = run_spec(
                f"profile-{stream}",
                router,
                engines,
                ctx.model,
                concurrency=CONCURRENCY,
                max_requests=1_000_000,
                duration_s=seconds + 1.0,
                stream=stream,
                max_tokens=MAX_TOKENS,
                prompt_words=PROMPT_WORDS,
                warmup_requests=CONCURRENCY,
            )
            load = asyncio.create_task(measure(ctx, router, spec))
            await asyncio.sleep(0.5)
            error = await _record(ctx, router.proc.pid, seconds, out)
            m = await load
            key = "stream" if stream == "yes" else "json"
            profiles[key] = {
                "throughput": m.result.throughput,
                "file": out.name,
                **({"error": error} if error else summarise(out)),
            }
            ctx.log(f"profile {key}: {profiles[key].get('samples', 0)} busy samples")
        await router.stop()
    finally:
        await fleet.stop()
        await ctx.loadgen.reset()
    return {"seconds": seconds, "rate_hz": RATE_HZ, "concurrency": CONCURRENCY, **profiles}
