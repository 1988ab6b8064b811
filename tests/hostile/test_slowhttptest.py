"""Slow clients by Debian's `slowhttptest`, against both process modes: slow headers
(Slowloris), slow body (R-U-Dead-Yet) and slow read, 300 connections each. The router answers
every slow head and body with a 408 at its timeout and closes, counts them, and stays
available throughout (slowhttptest's own probe, and the legitimate flow: conftest's guard).

slowhttptest has no option for extra headers: the client key rides in its Cookie value, which
it writes into the request as given (`x`, CRLF, then the `Authorization` line).
"""

from __future__ import annotations

import asyncio
import csv
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.hostile.conftest import SERVING, Hostile
from tests.hostile.metrics import rejected
from tests.support.poll import eventually

CONNECTIONS = 300
AUTH = "x\r\nAuthorization: Bearer sk-hostile"


@dataclass(frozen=True)
class Attack:
    flags: tuple[str, ...]
    path: str
    reason: str | None  # what every one of its connections is refused for


ATTACKS = {
    # a header line every 2 s: the whole head takes longer than client_header_timeout_s
    "slow-headers": Attack(("-H", "-t", "POST"), "/v1/completions", "header_timeout"),
    # a piece of an 8 KiB body every 2 s: longer than client_body_timeout_s between reads
    "slow-body": Attack(
        ("-B", "-s", "8192", "-f", "application/json"), "/v1/completions", "body_timeout"
    ),
    # 10 pipelined requests per connection (its most), read 16 bytes a second, tiny window
    "slow-read": Attack(
        ("-X", "-k", "10", "-n", "1", "-w", "16", "-y", "64", "-z", "16"), "/v1/models", None
    ),
}


def _available(path: Path) -> list[bool]:
    """Per second, from slowhttptest's CSV: did its probe get an answer in time? (The last
    column is the connection count while it did, 0 while it did not; the first row is from
    before anything started.)"""
    with path.open() as f:
        return [int(r["Service Available"]) > 0 for r in list(csv.DictReader(f))[1:]]


@pytest.mark.parametrize("name", ATTACKS)
async def test_slowhttptest(hostile: Hostile, name: str, tmp_path: Path) -> None:
    exe = shutil.which("slowhttptest")
    if exe is None:
        pytest.fail("install Debian's slowhttptest (`make test` does)")
    attack = ATTACKS[name]
    reason = attack.reason
    before = await asyncio.to_thread(rejected, hostile.url, reason) if reason else 0.0
    argv = [exe, *attack.flags, "-c", str(CONNECTIONS), "-r", "150", "-i", "2", "-l", "6"]
    argv += ["-p", "3", "-g", "-o", str(tmp_path / "report"), "-j", AUTH]
    argv += ["-u", f"{hostile.url}{attack.path}"]
    proc = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    async with asyncio.timeout(60):
        out, _ = await proc.communicate()
    text = out.decode(errors="replace")
    assert proc.returncode == 0, text[-2000:]
    seconds = _available(tmp_path / "report.csv")
    assert seconds and all(seconds), f"the probe went unanswered: {seconds}"
    if reason is None:
        assert "Hit test time limit" in text, text[-1000:]  # slow reads are served, slowly
        return
    # The router closed every connection before the attack's 6 s were up.
    assert SERVING["client_header_timeout_s"] < 2 and SERVING["client_body_timeout_s"] < 2
    assert "No open connections left" in text, text[-1000:]

    async def counted() -> bool:
        now = await asyncio.to_thread(rejected, hostile.url, reason)
        return now - before >= 0.9 * CONNECTIONS

    await eventually(counted, timeout_s=10, what=f"the slow clients counted as {reason}")
