"""The control pool's cost per health check: the router's CPU for one `GET /health` to an engine.

    .venv/bin/python -m bench.control_pool_bench [--checks N]

The engines are a separate process (aiohttp answering `/health` with `ok` on 16 ports), so the
CPU measured (`time.process_time`) is the client's alone: `EngineClient`'s control pool through
`control_get`, as the monitor's health stage calls it, on the control process's plain asyncio
loop. Three patterns:

- `reused`: one engine, checks one after another (every check on the kept socket);
- `fresh`: two engines alternating with `control_connections: 1` (every check closes the idle
  socket to the other engine and opens one: the bound's price);
- `sweep`: 16 engines checked concurrently with `control_connections: 8`, as a monitor pass.

The numbers go into docs/performance-log.md.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
from dataclasses import dataclass

from narwhal.engine.transport import EngineClient, control_get

ENGINES = 16


@dataclass(frozen=True)
class _Engine:
    url: str

    def resolved_api_key(self) -> str | None:
        return None


def _serve() -> None:
    """The engines' process: `/health` on ENGINES ports; prints the ports, runs until stdin ends."""
    from aiohttp import web

    async def main() -> None:
        async def health(request: web.Request) -> web.Response:
            return web.Response(text="ok")

        app = web.Application()
        app.router.add_get("/health", health)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        ports = []
        for _ in range(ENGINES):
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            ports.append(runner.addresses[-1][1])
        print(" ".join(map(str, ports)), flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
        await runner.cleanup()

    asyncio.run(main())


async def _pattern(name: str, urls: list[str], checks: int) -> tuple[float, float]:
    """(client CPU µs per check, wall µs per check), best of 3 runs."""
    limit = {"reused": 1, "fresh": 1, "sweep": 8}[name]
    engines = {
        "reused": [_Engine(urls[0])],
        "fresh": [_Engine(urls[0]), _Engine(urls[1])],
        "sweep": [_Engine(u) for u in urls],
    }[name]
    best = (float("inf"), float("inf"))
    for _ in range(3):
        client = EngineClient(data_limit=4, control_limit=limit)
        await client.start()
        try:
            for engine in engines:  # warm: every engine answered once
                await control_get(client, engine, "/health", 5.0)
            cpu, wall = time.process_time(), time.perf_counter()
            if name == "sweep":
                for _ in range(checks // len(engines)):
                    replies = await asyncio.gather(
                        *(control_get(client, e, "/health", 5.0) for e in engines)
                    )
                    assert all(r.status == 200 for r in replies)
                done = checks // len(engines) * len(engines)
            else:
                for i in range(checks):
                    reply = await control_get(client, engines[i % len(engines)], "/health", 5.0)
                    assert reply.status == 200
                done = checks
            cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        finally:
            await client.close()
        best = min(best, (cpu / done * 1e6, wall / done * 1e6))
    return best


async def _run(urls: list[str], checks: int) -> None:
    for name in ("reused", "fresh", "sweep"):
        cpu_us, wall_us = await _pattern(name, urls, checks)
        print(f"{name:>7}: {cpu_us:7.1f} us CPU per check, {wall_us:7.1f} us wall")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checks", type=int, default=2000)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        _serve()
        return
    server = subprocess.Popen(
        [sys.executable, "-m", "bench.control_pool_bench", "--serve"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert server.stdin is not None and server.stdout is not None
    try:
        urls = [f"http://127.0.0.1:{port}" for port in server.stdout.readline().split()]
        asyncio.run(_run(urls, args.checks))
    finally:
        server.stdin.close()
        server.wait(timeout=10)


if __name__ == "__main__":
    main()
