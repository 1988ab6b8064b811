"""A router's HTTP surfaces served on a loopback port without `Router.run` (no monitor, no
lease): for scenario tests that step a fake clock and read `/ready`, `/v1/*` or `/admin/*`."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp

from narwhal.server import Router


@asynccontextmanager
async def serve_http(router: Router) -> AsyncIterator[aiohttp.ClientSession]:
    """A client session whose relative paths reach the router, as `serving.workers: 1`
    serves them (the client server forwarding the admin surface)."""
    runtime = Path(tempfile.mkdtemp(prefix="narwhal-test-"))
    try:
        async with (
            router.surfaces("127.0.0.1", 0, runtime) as port,
            aiohttp.ClientSession(base_url=f"http://127.0.0.1:{port}") as http,
        ):
            yield http
    finally:
        shutil.rmtree(runtime, ignore_errors=True)
