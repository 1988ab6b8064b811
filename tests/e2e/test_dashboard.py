"""The dashboard in a real headless browser: it renders the engines and follows a drain."""

from __future__ import annotations

import asyncio
import shutil
import urllib.request
from pathlib import Path

import pytest

from tests.support.router import StartRouter
from tests.support.sim_process import SimFactory

ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts"


def _chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    assert path, "chromium is missing: `make test` installs Debian's chromium package"
    return path


async def _browser(tmp_path: Path, *args: str) -> str:
    proc = await asyncio.create_subprocess_exec(
        _chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
        "--no-first-run", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", f"--user-data-dir={tmp_path / 'chromium'}",
        "--virtual-time-budget=5000", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    async with asyncio.timeout(60):
        out, _ = await proc.communicate()
    assert proc.returncode == 0
    return out.decode()


@pytest.mark.slow
async def test_dashboard_renders_engines_and_follows_a_drain(
    sim_factory: SimFactory, start_router: StartRouter, tmp_path: Path
) -> None:
    prefill, decode = sim_factory.start_many([["--role", "prefill"], ["--role", "decode"]])
    rr = await start_router([
        {"id": "p0", "url": prefill.url, "role": "prefill"},
        {"id": "d0", "url": decode.url, "role": "decode"},
    ])  # fmt: skip
    page = rr.url + "/dashboard"

    dom = await _browser(tmp_path, "--dump-dom", page)
    assert 'data-engine="p0"' in dom and 'data-engine="d0"' in dom
    assert "operator_drain" not in dom

    req = urllib.request.Request(rr.url + "/admin/engines/d0/drain", method="POST")
    await asyncio.to_thread(urllib.request.urlopen, req)

    dom = await _browser(tmp_path, "--dump-dom", page)
    row = dom.split('data-engine="d0"', 1)[1].split("</tr>", 1)[0]
    assert "operator_drain" in row
    assert "no capacity: decode" in dom

    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "dashboard.png"
    await _browser(tmp_path, f"--screenshot={shot}", "--window-size=1200,800", page)
    assert shot.stat().st_size > 0
