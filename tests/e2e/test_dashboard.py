"""The dashboard in a real headless browser: it renders the engines and follows a drain live.

One page stays open in headless chromium (`--remote-debugging-port=0`); the test reads its DOM
over the DevTools protocol (a websocket, `Runtime.evaluate`), drains an engine through the
admin API and polls the same page until its own refresh shows the hold. Reloading is never
used, so the test fails if the page stops refreshing itself. The page logs in with `?token=`.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import re
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.support.poll import eventually
from tests.support.router import StartRouter
from tests.support.sim_process import SimFactory

ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts"
TOKEN = "dash-s3cret"


def _chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    assert path, "chromium is missing: `make test` installs Debian's chromium package"
    return path


class Page:
    """One open browser tab driven over the DevTools protocol."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self._ws = ws
        self._ids = itertools.count(1)

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        call_id = next(self._ids)
        await self._ws.send_json({"id": call_id, "method": method, "params": params})
        async with asyncio.timeout(30):
            while True:
                msg = await self._ws.receive()
                assert msg.type == aiohttp.WSMsgType.TEXT, f"devtools socket closed: {msg}"
                reply = json.loads(msg.data)
                if reply.get("id") == call_id:  # events (no id) are skipped
                    assert "error" not in reply, reply
                    result: dict[str, Any] = reply["result"]
                    return result

    async def evaluate(self, expression: str) -> Any:
        result = await self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        return result["result"].get("value")

    async def html(self) -> str:
        return str(await self.evaluate("document.documentElement.outerHTML"))

    async def screenshot(self, path: Path) -> None:
        shot = await self.call("Page.captureScreenshot", format="png")
        await asyncio.to_thread(path.write_bytes, base64.b64decode(shot["data"]))


@contextlib.asynccontextmanager
async def open_page(url: str, profile: Path) -> AsyncIterator[Page]:
    proc = await asyncio.create_subprocess_exec(
        _chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
        "--no-first-run", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--remote-debugging-port=0", "--remote-allow-origins=*",
        "--window-size=1200,800", f"--user-data-dir={profile}", url,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        assert proc.stderr is not None
        port = None
        async with asyncio.timeout(60):
            while port is None:
                line = (await proc.stderr.readline()).decode()
                assert line, "chromium exited before opening its DevTools port"
                found = re.search(r"DevTools listening on ws://[^:]+:(\d+)/", line)
                port = int(found[1]) if found else None
        drain = asyncio.create_task(proc.stderr.read())  # keep the pipe from filling up
        async with aiohttp.ClientSession() as http:

            async def page_target() -> str | None:
                async with http.get(f"http://127.0.0.1:{port}/json/list") as resp:
                    targets = await resp.json(content_type=None)
                return next(
                    (
                        t["webSocketDebuggerUrl"]
                        for t in targets
                        if t.get("type") == "page" and t.get("url", "").startswith(url)
                    ),
                    None,
                )

            ws_url = await eventually(page_target, timeout_s=30, what="the dashboard tab")
            async with http.ws_connect(ws_url, max_msg_size=0) as ws:
                yield Page(ws)
        drain.cancel()
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()


@pytest.mark.slow
async def test_dashboard_renders_engines_and_follows_a_drain(
    sim_factory: SimFactory, start_router: StartRouter, tmp_path: Path
) -> None:
    prefill, decode = sim_factory.start_many([["--role", "prefill"], ["--role", "decode"]])
    rr = await start_router(
        [
            {"id": "p0", "url": prefill.url, "role": "prefill"},
            {"id": "d0", "url": decode.url, "role": "decode"},
        ],
        admin={"token": TOKEN},
    )
    page_url = f"{rr.url}/dashboard?token={TOKEN}"

    async with open_page(page_url, tmp_path / "chromium") as page:

        async def rendered() -> str | None:
            dom = await page.html()
            return dom if 'data-engine="p0"' in dom and 'data-engine="d0"' in dom else None

        dom = await eventually(rendered, timeout_s=30, what="the engines rendered")
        assert "operator_drain" not in dom
        # `?token=` logged the page in (the engines come from the token-protected API).
        assert await page.evaluate("getComputedStyle(document.getElementById('auth')).display") == (
            "none"
        )

        async with (
            aiohttp.ClientSession() as http,
            http.post(
                rr.url + "/admin/engines/d0/drain",
                headers={"Authorization": f"Bearer {TOKEN}"},
            ) as resp,
        ):
            assert resp.status == 200, await resp.text()

        row_js = "document.querySelector('tr[data-engine=\"d0\"]')?.outerHTML || ''"

        async def drained_row() -> str | None:
            row = str(await page.evaluate(row_js))
            return row if "operator_drain" in row else None

        # The same page, never reloaded: only its own periodic refresh can show the drain.
        row = await eventually(drained_row, timeout_s=30, what="the drain on the open page")
        assert 'class="bad">no<' in row  # not eligible
        status = await eventually(
            lambda: page.evaluate("document.getElementById('status').textContent"),
            what="the status line",
        )
        await eventually(
            lambda: page.evaluate(
                "document.getElementById('status').textContent.includes('no capacity: decode')"
            ),
            timeout_s=30,
            what=f"no capacity in the status line (last {status!r})",
        )

        ARTIFACTS.mkdir(exist_ok=True)
        shot = ARTIFACTS / "dashboard.png"
        await page.screenshot(shot)
        assert shot.stat().st_size > 0
