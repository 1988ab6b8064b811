"""`narwhal-serve --demo` as a real process: it serves, and SIGINT stops it, its engines and
its data-plane workers."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp
import openai
import pytest

from tests.support.cli import narwhal
from tests.support.poll import eventually
from tests.support.ports import free_port

START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 15.0
BANNER_END = "Ctrl-C stops the router and the engines."


def _children(pid: int, module: str) -> list[int]:
    """Live child processes of `pid` running `python -m <module>`, from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == pid and module.encode() in argv:
            found.append(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


async def _banner(log_path: Path, proc: asyncio.subprocess.Process) -> str:
    """The demo's log once its banner's last line is in it; fail at once, with the log, if
    the demo exited."""

    async def printed() -> str:
        text = await asyncio.to_thread(log_path.read_text)
        if BANNER_END in text:
            return text
        if proc.returncode is not None:
            raise AssertionError(text)
        return ""

    return await eventually(
        printed, timeout_s=START_TIMEOUT_S, interval_s=0.1, what="the demo's banner"
    )


@pytest.mark.slow
async def test_demo_serves_a_completion_and_stops_on_sigint(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "demo.log"
    log = log_path.open("wb")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "narwhal.cli.serve", "--demo", "--listen", f"127.0.0.1:{port}",
        cwd=tmp_path,
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
    )  # fmt: skip
    engines: list[int] = []
    try:
        # The banner is the demo's start signal: it is printed once every worker listens,
        # and then the first `/ready` answers 200 (docs/monitor.md). `/ready` alone can turn
        # 200 earlier, through the first worker to listen, before the banner is out.
        banner = await _banner(log_path, proc)
        async with aiohttp.ClientSession() as http, http.get(url + "/ready") as r:
            assert (r.status, await r.text()) == (200, "ready")
        engines = _children(proc.pid, "narwhal.sim.cli")
        assert len(engines) == 5, "2 prefill + 2 decode narwhal-sim processes, and a spare"
        (zygote,) = _children(proc.pid, "narwhal.process.zygote")
        workers = _children(zygote, "narwhal.process.zygote")  # forked: the zygote's argv
        assert len(workers) == len(os.sched_getaffinity(0)), "workers: auto"
        engines += [zygote, *workers]

        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        try:
            answer = await asyncio.wait_for(
                client.completions.create(model="demo-model", prompt="Hello narwhal", max_tokens=8),
                timeout=10,
            )
            chat = await asyncio.wait_for(
                client.chat.completions.create(
                    model="demo-model",
                    messages=[{"role": "user", "content": "Hi"}],
                    max_tokens=5,
                ),
                timeout=10,
            )
        finally:
            await client.close()
        assert len(answer.choices[0].text.split()) == 8
        assert answer.usage is not None and answer.usage.prompt_tokens_details is not None
        assert answer.usage.prompt_tokens_details.cached_tokens == answer.usage.prompt_tokens
        assert chat.choices[0].message.content

        # The banner's shared-prefix workload, as printed but shorter, then the hit rate
        # `narwhal status` shows: the demo places by prefix over engines that cache them.
        (bench,) = [
            line.split()[1:]
            for line in banner.splitlines()
            if line.strip().startswith("narwhal-sim bench ")
        ]
        bench[bench.index("--duration-s") + 1] = "2"
        ran = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "narwhal.sim.cli", *bench, stdout=subprocess.PIPE
        )
        out, _ = await asyncio.wait_for(ran.communicate(), timeout=30)
        assert ran.returncode == 0 and b"(0 errors)" in out, out
        status = await narwhal("status", "--url", url)
        assert status.code == 0, status.err
        rate = re.search(r"demo-model hit rate ([\d.]+)%", status.out)
        assert rate and float(rate[1]) > 50, status.out

        # The banner's membership commands, as printed, against the live demo.
        commands = [
            line.split()[1:]
            for line in banner.splitlines()
            if line.strip().startswith("narwhal engines ")
        ]
        assert [c[:2] for c in commands] == [["engines", "add"], ["engines", "remove"]]
        for command, last in zip(commands, ("d2: in service", "d2: removed"), strict=True):
            cli = await narwhal(*command)
            assert cli.code == 0, cli.err
            assert cli.out.splitlines()[-1] == last

        proc.send_signal(signal.SIGINT)
        status = await asyncio.wait_for(proc.wait(), STOP_TIMEOUT_S)
        assert status == 0, log_path.read_text()
        await eventually(
            lambda: not any(_alive(pid) for pid in engines),
            timeout_s=5,
            what="demo engines and workers stopped",
        )
    finally:
        for pid in [proc.pid, *engines]:
            if _alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(proc.wait(), 5)
        log.close()
