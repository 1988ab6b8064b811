"""The dashboard, an operator console, in a real headless browser (issue 20 §4).

One page stays open in headless chromium (`--remote-debugging-port=0`); the test drives it over
the DevTools protocol (a websocket, `Runtime.evaluate`) as an operator would: it signs in through
the form (a wrong token first: the 401 brings the form back), reads the per-engine sparklines and
their axes, drains an engine with the row's button (the confirmation accepted), finds the drain
in the event timeline, and readmits the engine with its button, which shows the verification
steps. Reloading is never used, so the test fails if the page stops refreshing itself; the
token never appears in a URL the page requests (Network events) or in its own address.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import re
import shutil
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.support.poll import eventually
from tests.support.router import StartRouter
from tests.support.sim_process import SimFactory

ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts"
TOKEN = "dash-s3cret"
WIDTH = 1200  # the browser window's width, in CSS pixels
TOKEN_KEY = "narwhal-token"  # the page's sessionStorage key


def _chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    assert path, "chromium is missing: `make test` installs Debian's chromium package"
    return path


class Page:
    """One open browser tab driven over the DevTools protocol."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self._ws = ws
        self._ids = itertools.count(1)
        self.events: list[dict[str, Any]] = []  # DevTools events (e.g. Network.*) seen so far

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        call_id = next(self._ids)
        await self._ws.send_json({"id": call_id, "method": method, "params": params})
        async with asyncio.timeout(30):
            while True:
                msg = await self._ws.receive()
                assert msg.type == aiohttp.WSMsgType.TEXT, f"devtools socket closed: {msg}"
                reply = json.loads(msg.data)
                if "method" in reply:  # an event, not a reply
                    self.events.append(reply)
                    continue
                if reply.get("id") == call_id:
                    assert "error" not in reply, reply
                    result: dict[str, Any] = reply["result"]
                    return result

    async def evaluate(self, expression: str) -> Any:
        result = await self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        return result["result"].get("value")

    async def html(self) -> str:
        return str(await self.evaluate("document.documentElement.outerHTML"))

    async def screenshot(self, path: Path) -> None:
        """The whole page: the window is made as tall as the page, without scrollbars."""
        await self.call("Emulation.setScrollbarsHidden", hidden=True)
        try:
            for _ in range(2):  # again once the scrollbar is gone: the page may reflow
                height = int(await self.evaluate("document.documentElement.scrollHeight"))
                await self.call(
                    "Emulation.setDeviceMetricsOverride",
                    width=WIDTH, height=height, deviceScaleFactor=1, mobile=False,
                )  # fmt: skip
            shot = await self.call("Page.captureScreenshot", format="png")
        finally:
            await self.call("Emulation.clearDeviceMetricsOverride")
            await self.call("Emulation.setScrollbarsHidden", hidden=False)
        await asyncio.to_thread(path.write_bytes, base64.b64decode(shot["data"]))

    async def sign_in(self, token: str) -> None:
        """Type the token into the login field and click the button, as an operator would."""
        typed = json.dumps(token)
        await self.evaluate(
            "(() => { const field = document.getElementById('token'); field.focus();"
            f" field.value = {typed}; field.dispatchEvent(new Event('input', {{bubbles: true}}));"
            " document.getElementById('signin').click(); })()"
        )

    async def click(self, selector: str) -> None:
        """Click the element once it is there and enabled (a button is disabled while its
        engine's previous action runs)."""
        script = (
            f"(() => {{ const b = document.querySelector({json.dumps(selector)});"
            " if (!b || b.disabled) return false; b.click(); return true; })()"
        )
        await eventually(lambda: self.evaluate(script), timeout_s=10, what=f"to click {selector}")


@contextlib.asynccontextmanager
async def open_page(url: str, profile: Path) -> AsyncIterator[Page]:
    proc = await asyncio.create_subprocess_exec(
        _chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
        "--no-first-run", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--remote-debugging-port=0", "--remote-allow-origins=*",
        f"--window-size={WIDTH},800", f"--user-data-dir={profile}", url,
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


# The sparklines and their axes, per engine card, as the page drew them.
SPARKS_JS = """[...document.querySelectorAll('[data-engine-card]')].map((card) => ({
  engine: card.dataset.engineCard,
  charts: [...card.querySelectorAll('svg.chart')].map((svg) => ({
    metric: svg.dataset.metric,
    y_label: svg.querySelector('.y-label')?.textContent,
    x_label: svg.querySelector('.x-label')?.textContent,
    x_ticks: [...svg.querySelectorAll('.x-tick')].map((t) => t.textContent),
    y_ticks: [...svg.querySelectorAll('.y-tick')].map((t) => t.textContent),
    lines: [...svg.querySelectorAll('polyline')].filter((l) => l.points.length > 1).length,
  })),
}))"""
EVENTS_JS = """[...document.querySelectorAll('#events li')].map((li) => ({
  seq: Number(li.dataset.seq), kind: li.dataset.kind, engine: li.dataset.engine,
  time: li.querySelector('time').textContent, what: li.querySelector('.what').textContent,
}))"""
UNITS = {"rate": "req/s", "errors": "errors/s", "latency": "ms", "in_flight": "requests"}


def _visible(element_id: str) -> str:
    return f"!document.getElementById('{element_id}').hidden"


@pytest.mark.slow
async def test_dashboard_console_signs_in_charts_and_drives_the_operator_api(
    sim_factory: SimFactory, start_router: StartRouter, tmp_path: Path
) -> None:
    prefill, decode = sim_factory.start_many(
        [["--role", "prefill"], ["--role", "decode", "--itl-ms", "20"]]
    )
    rr = await start_router(
        [
            {"id": "p0", "url": prefill.url, "role": "prefill"},
            {"id": "d0", "url": decode.url, "role": "decode"},
        ],
        admin={"token": TOKEN},
        controller={"interval_s": 1.0},  # per-engine windows close every second
    )
    page_url = f"{rr.url}/dashboard"
    ARTIFACTS.mkdir(exist_ok=True)

    async def traffic(http: aiohttp.ClientSession) -> None:
        body = {"model": "demo-model", "prompt": "hello narwhal", "max_tokens": 12, "stream": True}
        while True:
            with contextlib.suppress(aiohttp.ClientError):
                async with http.post(rr.url + "/v1/completions", json=body) as resp:
                    await resp.read()
            await asyncio.sleep(0.05)

    async with (
        open_page(page_url, tmp_path / "chromium") as page,
        aiohttp.ClientSession() as http,
    ):
        await page.call("Network.enable")
        load = [asyncio.create_task(traffic(http)) for _ in range(2)]
        try:
            await _sign_in(page)
            await _sparklines(page)
            await _drain_by_button(page, rr.holds)
            await _readmit_by_button(page, rr.holds)
            await page.screenshot(ARTIFACTS / "dashboard.png")
        finally:
            for task in load:
                task.cancel()
            await asyncio.gather(*load, return_exceptions=True)

        # Never reloaded, never navigated, and the token never in a URL.
        assert await page.evaluate("window.__sameDocument === true")
        assert await page.evaluate("location.href") == page_url
        sent = [
            e["params"]["request"]
            for e in page.events
            if e.get("method") == "Network.requestWillBeSent"
        ]
        assert sent, "no network events seen"
        assert not [r["url"] for r in sent if TOKEN in r["url"]]
        admin = [r for r in sent if "/admin/" in r["url"]]
        paths = {r["url"].split("?")[0].removeprefix(rr.url) for r in admin}
        assert paths >= {"/admin/dashboard", "/admin/events", "/admin/engines/d0/drain",
                         "/admin/engines/d0/readmit"}  # fmt: skip
        assert "/admin/engines/p0/maintenance" not in paths  # its confirmation was declined
        assert any(r["headers"].get("Authorization") == f"Bearer {TOKEN}" for r in admin)


async def _sign_in(page: Page) -> None:
    """The form and nothing else until signed in; a wrong token brings the form back."""
    await eventually(lambda: page.evaluate(_visible("login")), timeout_s=30, what="the form")
    await page.evaluate("window.__sameDocument = true")  # gone if the page ever reloads
    assert not await page.evaluate(_visible("console"))
    assert 'data-engine="p0"' not in await page.html()
    await page.screenshot(ARTIFACTS / "dashboard-login.png")

    await page.sign_in("not-the-token")
    await eventually(
        lambda: page.evaluate(
            "document.getElementById('login-msg').textContent.includes('refused')"
        ),
        timeout_s=30,
        what="the form again after a 401",
    )
    assert await page.evaluate(_visible("login"))
    assert await page.evaluate(f"sessionStorage.getItem('{TOKEN_KEY}')") is None

    await page.sign_in(TOKEN)

    async def rendered() -> str | None:
        dom = await page.html()
        return dom if 'data-engine="p0"' in dom and 'data-engine="d0"' in dom else None

    dom = await eventually(rendered, timeout_s=30, what="the engines rendered")
    assert "operator_drain" not in dom
    assert not await page.evaluate(_visible("login"))
    assert await page.evaluate(_visible("console"))
    assert await page.evaluate(f"sessionStorage.getItem('{TOKEN_KEY}')") == TOKEN
    assert TOKEN not in await page.evaluate("location.href")


async def _sparklines(page: Page) -> None:
    """Four charts per engine, with labelled axes and units, drawn from the traffic."""

    async def drawn() -> list[dict[str, Any]] | None:
        cards = await page.evaluate(SPARKS_JS)
        by_engine = {c["engine"]: {s["metric"]: s for s in c["charts"]} for c in cards}
        if set(by_engine) != {"p0", "d0"}:
            return None
        # Latency exists only where legs completed: traffic went through both engines.
        ok = all(charts["latency"]["lines"] and charts["rate"]["lines"]
                 for charts in by_engine.values())  # fmt: skip
        return cards if ok else None

    cards = await eventually(drawn, timeout_s=30, what="sparklines with data")
    for card in cards:
        assert [c["metric"] for c in card["charts"]] == list(UNITS), card
        for c in card["charts"]:
            assert c["y_label"] == UNITS[c["metric"]], c
            assert c["x_label"] == "time", c
            assert c["x_ticks"][0].startswith("\u2212") and c["x_ticks"][-1] == "now", c
            assert c["y_ticks"][-1] == "0" and float(c["y_ticks"][0]) > 0, c
    fleet = await page.evaluate(
        "[...document.querySelectorAll('#rate .y-label, #latency .y-label')]"
        ".map((t) => t.textContent)"
    )
    assert fleet == ["requests", "ms"]
    placement = await page.evaluate("document.getElementById('placement').textContent")
    assert placement == "policy least_loaded", placement  # the default: no index to show


async def _drain_by_button(page: Page, holds: Callable[[str], list[str]]) -> None:
    """A cancelled confirmation changes nothing; an accepted one drains, and the event
    timeline shows it (newest first) without a reload."""
    await page.evaluate(
        "window.__confirms = [];"
        " window.confirm = (m) => { window.__confirms.push(m); return false; }"
    )
    await page.click('tr[data-engine="p0"] button[data-action="maintenance"]')
    assert await page.evaluate("window.__confirms.length") == 1
    assert holds("p0") == []  # and no request was sent (checked with the network log at the end)

    await page.evaluate("window.confirm = (m) => { window.__confirms.push(m); return true; }")
    seen_before = await page.evaluate(EVENTS_JS)
    await page.click('tr[data-engine="d0"] button[data-action="drain"]')
    confirms = await page.evaluate("window.__confirms")
    assert len(confirms) == 2 and "d0" in confirms[1], confirms

    row_js = "document.querySelector('tr[data-engine=\"d0\"]')?.outerHTML || ''"

    async def drained_row() -> str | None:
        row = str(await page.evaluate(row_js))
        return row if "operator_drain" in row else None

    row = await eventually(drained_row, timeout_s=30, what="the drain on the open page")
    assert '<td class="bad">no</td>' in row  # not eligible
    assert holds("d0") == ["operator_drain"]
    action = await page.evaluate("document.getElementById('action').textContent")
    assert "drain d0" in action and "operator_drain" in action, action

    async def drain_event() -> list[dict[str, Any]] | None:
        events = await page.evaluate(EVENTS_JS)
        new = [e for e in events if e["seq"] > max((e["seq"] for e in seen_before), default=0)]
        return events if any(e["engine"] == "d0" and "drain" in e["what"] for e in new) else None

    events = await eventually(drain_event, timeout_s=30, what="the drain in the event timeline")
    seqs = [e["seq"] for e in events]
    assert seqs == sorted(seqs, reverse=True)  # newest first
    drained = next(e for e in events if e["engine"] == "d0" and "drain" in e["what"])
    assert drained["kind"] == "transition" and "from the dashboard" in drained["what"], drained
    assert re.fullmatch(r"\d{2}:\d{2}:\d{2}", drained["time"]), drained

    await eventually(
        lambda: page.evaluate(
            "document.getElementById('status').textContent.includes('no capacity: decode')"
        ),
        timeout_s=30,
        what="no capacity in the status line",
    )


async def _readmit_by_button(page: Page, holds: Callable[[str], list[str]]) -> None:
    """Readmit shows each verification step and the verdict; the drain is gone after it."""
    await page.click('tr[data-engine="d0"] button[data-action="readmit"]')

    async def verdict() -> str | None:
        text = str(await page.evaluate("document.querySelector('#action .verdict')?.textContent"))
        return text if text not in ("None", "…") else None

    assert await eventually(verdict, timeout_s=30, what="the readmission's verdict") == (
        "readmitted"
    )
    steps = await page.evaluate(
        "[...document.querySelectorAll('#action .step')].map((li) => [li.dataset.step,"
        " li.textContent])"
    )
    assert [s for s, _ in steps] == [
        "health", "attestation", "model_identity", "generation_identity", "kv_transfer",
        "final_health",
    ], steps  # fmt: skip
    assert steps[0][1].startswith("ok health"), steps
    assert holds("d0") == []

    async def back() -> bool:
        row = str(await page.evaluate("document.querySelector('tr[data-engine=\"d0\"]').outerHTML"))
        return "operator_drain" not in row and '<td class="ok">yes</td>' in row

    await eventually(back, timeout_s=30, what="d0 eligible again on the open page")
