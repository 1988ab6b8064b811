"""wrk, the C load generator: installing it, its request script, one run, its output parsed.

`wrk -t1 -c{c} -d{s}s --latency --timeout {t}s -s <script> <url>`: one thread, `c` connections
in a closed loop, each sending the same POST (the script sets the method, the JSON body and its
Content-Type) for `s` seconds. Its CPU is read from the kernel when it exits (`os.wait4`).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

WRK = "wrk"
DEBIAN_PACKAGE = "wrk"
THREADS = 1
_UNITS_MS = {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 60e3, "h": 3600e3}
_DURATION_S = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_SIZE = r"([0-9.]+)([a-z]+)"


@dataclass(frozen=True, slots=True)
class WrkResult:
    """What one wrk run printed. `non_2xx` is wrk's "Non-2xx or 3xx responses" (a status of
    400 or more); the socket errors are wrk's connect/read/write/timeout counts (a timeout is a
    request still unanswered after `--timeout`)."""

    requests: int
    duration_s: float
    rps: float
    non_2xx: int
    connect_errors: int
    read_errors: int
    write_errors: int
    timeouts: int
    p50_ms: float
    p90_ms: float
    p99_ms: float

    @property
    def socket_errors(self) -> int:
        return self.connect_errors + self.read_errors + self.write_errors + self.timeouts

    @property
    def failed(self) -> int:
        """Requests that did not end in a 2xx/3xx: error statuses plus read errors and
        timeouts (connect and write errors are not requests wrk counted)."""
        return self.non_2xx + self.read_errors + self.timeouts


def _ms(value: str, unit: str) -> float:
    return float(value) * _UNITS_MS[unit]


def parse_output(text: str) -> WrkResult:
    """wrk's stdout (run with `--latency`) as a WrkResult; ValueError when a line it always
    prints (requests, Requests/sec, the latency distribution) is missing. The percentiles are
    NaN when no request completed."""
    done = re.search(r"^\s*(\d+) requests in " + _SIZE + ",", text, re.M)
    rate = re.search(r"^Requests/sec:\s+([0-9.]+)", text, re.M)
    if done is None or rate is None:
        raise ValueError("not wrk output: no 'N requests in' or 'Requests/sec' line")
    dist = {q: re.search(rf"^\s+{q}%\s+" + _SIZE + r"\s*$", text, re.M) for q in ("50", "90", "99")}
    missing = [q for q, m in dist.items() if m is None]
    if missing:
        raise ValueError(f"no latency distribution for {missing} (run wrk with --latency)")
    errors = re.search(
        r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", text
    )
    non_2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", text)
    connect, read, write, timeout = (int(x) for x in errors.groups()) if errors else (0,) * 4
    requests = int(done[1])
    # with no request completed, wrk prints 0.00us for every percentile: not a latency
    p = {q: _ms(m[1], m[2]) if requests else math.nan for q, m in dist.items() if m is not None}
    return WrkResult(
        requests=requests,
        duration_s=float(done[2]) * _DURATION_S[done[3]],
        rps=float(rate[1]),
        non_2xx=int(non_2xx[1]) if non_2xx else 0,
        connect_errors=connect,
        read_errors=read,
        write_errors=write,
        timeouts=timeout,
        p50_ms=p["50"],
        p90_ms=p["90"],
        p99_ms=p["99"],
    )


def body(model: str, prompt_words: int, max_tokens: int, stream: bool) -> dict[str, Any]:
    """The one request every connection sends."""
    prompt = " ".join(f"w{i % 256}" for i in range(prompt_words))
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": stream}


def script(doc: dict[str, Any]) -> str:
    """The Lua script: POST, the JSON body (in a long bracket string no body can close), and
    its Content-Type."""
    encoded = json.dumps(doc, separators=(",", ":"))
    level = 0
    while f"]{'=' * level}]" in encoded:
        level += 1
    eq = "=" * level
    return (
        'wrk.method = "POST"\n'
        f"wrk.body = [{eq}[{encoded}]{eq}]\n"
        'wrk.headers["Content-Type"] = "application/json"\n'
    )


def argv(url: str, script_path: Path, c: int, seconds: float, timeout_s: float) -> list[str]:
    return [
        WRK,
        f"-t{THREADS}",
        f"-c{c}",
        f"-d{max(1, round(seconds))}s",
        "--latency",
        "--timeout",
        f"{max(1, round(timeout_s))}s",
        "-s",
        str(script_path),
        url,
    ]


@dataclass(frozen=True, slots=True)
class WrkRun:
    result: WrkResult
    cpu_s: float  # wrk's own utime + stime
    argv: tuple[str, ...]


def _run_blocking(cmd: list[str], out: Path) -> tuple[int, float, str]:
    """Run `cmd` with stdout and stderr to `out`; its exit status, its CPU (wait4) and what
    it printed."""
    with out.open("wb") as f:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=f, stderr=f)
    try:
        _, status, ru = os.wait4(proc.pid, 0)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, ru.ru_utime + ru.ru_stime, out.read_text(errors="replace")


async def run(
    url: str, script_path: Path, c: int, seconds: float, timeout_s: float, out: Path
) -> WrkRun:
    """One wrk run (in a thread: `wait4` blocks), its output kept in `out`; RuntimeError
    when wrk failed or printed something unreadable."""
    cmd = argv(url, script_path, c, seconds, timeout_s)
    code, cpu, text = await asyncio.to_thread(_run_blocking, cmd, out)
    if code != 0:
        raise RuntimeError(f"wrk exited {code}: {text[-400:]}")
    try:
        return WrkRun(parse_output(text), cpu, tuple(cmd))
    except ValueError as exc:
        raise RuntimeError(f"wrk: {exc}: {text[-400:]}") from None


async def ensure_installed(log: Path) -> str | None:
    """None when wrk is on PATH (installed now if need be, as `make system-deps` installs
    Debian packages: apt-get, as root); otherwise why it is not."""
    if shutil.which(WRK):
        return None
    if not shutil.which("apt-get"):
        return "wrk is not installed and this is not a Debian system (no apt-get)"
    if os.geteuid() != 0:
        return f"wrk is not installed (apt-get install {DEBIAN_PACKAGE} needs root)"
    script = (
        "apt-get update -qq && DEBIAN_FRONTEND=noninteractive "
        f"apt-get install -y -qq {DEBIAN_PACKAGE}"
    )
    with log.open("ab") as f:
        proc = await asyncio.create_subprocess_exec(
            "sh", "-c", script, stdin=subprocess.DEVNULL, stdout=f, stderr=f
        )
        code = await proc.wait()
    if code != 0 or not shutil.which(WRK):
        return f"wrk could not be installed (apt-get exited {code}; see {log.name})"
    return None
