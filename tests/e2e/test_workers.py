"""`serving.workers: 2`, end to end: one control process, two data-plane worker processes
(DESIGN §9), real `narwhal-sim` engines, real faults.

What is checked: a failure seen by one worker pauses the engine for the other before the
client has its answer; placement rotates across the workers as one router's; a crashed
worker is restarted, its requests counted as lost and nothing charged to an engine;
`/metrics` and `/admin` read the same through either worker; an operator drain holds on
every worker; killing the control process closes the port within 1 s and leaves no worker;
a stopped control process makes the workers refuse with `control process lost`; SIGTERM
lets a running stream finish. Which worker a connection reached is read from `/health`'s
`X-Narwhal-Worker` on a one-connection session.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from bench.suites import router_bound

from narwhal.process.supervisor import CONTROL_WINDOW_MIN_S
from tests.support.http import metric_sum
from tests.support.poll import eventually
from tests.support.ports import free_port
from tests.support.router import StartRouter, router_config
from tests.support.sim_process import SimFactory, SimProcess
from tests.support.sockets import accepted_connections

pytestmark = pytest.mark.slow

MODEL = "demo-model"
BODY = {"model": MODEL, "prompt": "hello", "max_tokens": 4}


@pytest.fixture(scope="module")
def sims() -> Iterator[list[SimProcess]]:
    """p0, p1 (prefill) and d0 (decode); d0 streams slowly enough to be caught mid-stream."""
    factory = SimFactory()
    try:
        yield factory.start_many(
            [["--role", "prefill", "--kv-role", "kv_producer"],
             ["--role", "prefill", "--kv-role", "kv_producer"],
             ["--role", "decode", "--kv-role", "kv_consumer", "--itl-ms", "20"]]
        )  # fmt: skip
    finally:
        factory.close()


def _engines(sims: list[SimProcess]) -> list[dict[str, Any]]:
    p0, p1, d0 = sims
    return [
        {"id": "p0", "url": p0.url, "role": "prefill"},
        {"id": "p1", "url": p1.url, "role": "prefill"},
        {"id": "d0", "url": d0.url, "role": "decode"},
    ]


async def _ready(http: aiohttp.ClientSession, url: str) -> None:
    async def ok() -> bool:
        try:
            async with http.get(url + "/ready") as r:
                return r.status == 200
        except aiohttp.ClientConnectionError:
            return False

    await eventually(ok, what=f"{url}/ready 200")


@contextlib.asynccontextmanager
async def _pinned(url: str, worker: int) -> AsyncIterator[aiohttp.ClientSession]:
    """A session whose one keep-alive connection was accepted by `worker`."""
    for _ in range(200):
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1))
        async with session.get(url + "/health") as r:
            await r.read()
            if r.headers["X-Narwhal-Worker"] == str(worker):
                try:
                    yield session
                finally:
                    await session.close()
                return
        await session.close()
    raise AssertionError(f"no connection reached worker {worker} in 200 tries")


def _client_requests(sim: SimProcess) -> list[dict[str, Any]]:
    return [r for r in sim.requests() if r["body"].get("prompt") == BODY["prompt"]]


async def _start(start_router: StartRouter, sims: list[SimProcess], **sections: Any) -> Any:
    serving = {"workers": 2, **sections.pop("serving", {})}
    rr = await start_router(_engines(sims), serving=serving, **sections)
    async with aiohttp.ClientSession() as http:
        await _ready(http, rr.url)
    return rr


async def _metrics(http: aiohttp.ClientSession, url: str) -> str:
    async with http.get(url + "/metrics") as r:
        assert r.status == 200
        return await r.text()


async def test_a_failure_seen_by_one_worker_pauses_the_engine_for_the_other(
    start_router: StartRouter, sims: list[SimProcess], tmp_path: Path
) -> None:
    p0 = sims[0]
    rr = await _start(start_router, sims, recovery={"eject_after": 1, "liveness_misses": 100})
    async with _pinned(rr.url, 0) as a, _pinned(rr.url, 1) as b:
        p0.add_fault({"kind": "completion_status", "status": 500, "leg": "prefill"})
        try:
            failed = 0
            for _ in range(10):
                async with a.post(rr.url + "/v1/completions", json=BODY) as r:
                    await r.read()
                    if r.status != 200:
                        failed += 1
                        break
            assert failed == 1, "worker 0 never placed a request on the failing p0"
            # At once, through the other worker: p0 is paused there too.
            p0.clear_requests()
            for _ in range(20):
                async with b.post(rr.url + "/v1/completions", json=BODY) as r:
                    assert r.status == 200, await r.text()
            assert _client_requests(p0) == []  # (the control process's probes aside)
        finally:
            p0.clear_faults()
    engines = {e["id"]: e for e in rr.router.engines_json()}
    assert engines["p0"]["ejected"] and not engines["p0"]["eligible"]


async def test_placement_rotates_across_workers_as_one_router(
    start_router: StartRouter, sims: list[SimProcess]
) -> None:
    """Requests alternating between the workers alternate between the prefill engines: the
    rotation is the router's, not each worker's (two rotations would give p0 p0 p1 p1)."""
    p0, p1 = sims[0], sims[1]
    rr = await _start(start_router, sims)
    async with _pinned(rr.url, 0) as a, _pinned(rr.url, 1) as b:
        picks = []
        for session in (a, b, a, b, a, b):
            before = len(_client_requests(p0)), len(_client_requests(p1))
            async with session.post(rr.url + "/v1/completions", json=BODY) as r:
                assert r.status == 200, await r.text()
            after = len(_client_requests(p0)), len(_client_requests(p1))
            picks.append("p0" if after[0] > before[0] else "p1")
            assert sum(after) - sum(before) == 1
    assert all(x != y for x, y in itertools.pairwise(picks)), picks


async def test_a_crashed_worker_is_restarted_and_its_requests_count_as_lost(
    start_router: StartRouter, sims: list[SimProcess]
) -> None:
    rr = await _start(start_router, sims)
    stream = {**BODY, "max_tokens": 500, "stream": True}
    async with _pinned(rr.url, 1) as victim, aiohttp.ClientSession() as http:
        before = (await (await http.get(rr.url + "/admin/workers")).json())["workers"]

        async def one() -> int:
            try:
                async with victim.post(rr.url + "/v1/completions", json=stream) as r:
                    await r.read()
                    return r.status
            except aiohttp.ClientError:
                return -1

        # One connection, so one stream at a time: it is in progress on worker 1.
        streaming = asyncio.create_task(one())
        await eventually(
            lambda: rr.router.supervisor.table.get(1, 0) == 1, what="a stream on worker 1"
        )
        os.kill(before[1]["pid"], signal.SIGKILL)
        assert await streaming == -1  # the client sees its connection drop
        workers = await eventually(_restarted(http, rr.url), what="worker 1 restarted")
        assert workers[1]["pid"] != before[1]["pid"] and workers[1]["restarts"] == 1
        assert workers[1]["last_exit"] == "SIGKILL"
        assert workers[0]["pid"] == before[0]["pid"] and workers[0]["restarts"] == 0
        # A restarted worker makes its request ids with a prefix of its own.
        prefixes = [before[0]["request_prefix"], before[1]["request_prefix"]]
        assert workers[1]["request_prefix"] not in prefixes and len(set(prefixes)) == 2
        text = await _metrics(http, rr.url)
        assert metric_sum(text, "narwhal_worker_lost_requests_total", endpoint="completions") == 1
        assert metric_sum(text, "narwhal_worker_exits_total", reason="signal") == 1
        assert metric_sum(text, "narwhal_engine_failures_total") == 0
        assert metric_sum(text, "narwhal_evidence_streak") == 0
        for _ in range(10):  # both workers serve again
            async with http.post(rr.url + "/v1/completions", json=BODY) as r:
                assert r.status == 200, await r.text()


async def test_a_killed_worker_spawner_takes_its_workers_and_both_come_back(
    start_router: StartRouter, sims: list[SimProcess]
) -> None:
    """Workers are forked by the router's zygote and die with it (their death signal); the
    router starts a new zygote and restarts every worker from it."""
    rr = await _start(start_router, sims, router_kwargs={"spawner": None})  # its own zygote
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as http:
        before = (await (await http.get(rr.url + "/admin/workers")).json())["workers"]
        parents = {_parent(w["pid"]) for w in before}
        assert len(parents) == 1 and os.getpid() not in parents
        os.kill(parents.pop(), signal.SIGKILL)

        async def both_restarted() -> list[dict[str, Any]] | None:
            try:  # with both workers gone nothing listens, for a moment
                async with http.get(rr.url + "/admin/workers") as r:
                    workers: list[dict[str, Any]] = (await r.json())["workers"]
            except aiohttp.ClientError:
                return None
            return workers if all(w["running"] and w["restarts"] for w in workers) else None

        workers = await eventually(both_restarted, what="both workers restarted")
        assert [w["last_exit"] for w in workers] == ["SIGKILL", "SIGKILL"]
        assert {w["pid"] for w in workers}.isdisjoint(w["pid"] for w in before)
        for _ in range(10):  # both serve again
            async with http.post(rr.url + "/v1/completions", json=BODY) as r:
                assert r.status == 200, await r.text()


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _restarted(http: aiohttp.ClientSession, url: str) -> Any:
    async def probe() -> list[dict[str, Any]] | None:
        async with http.get(url + "/admin/workers") as r:
            workers: list[dict[str, Any]] = (await r.json())["workers"]
        return workers if all(w["running"] for w in workers) and workers[1]["restarts"] else None

    return probe


async def test_max_connections_bounds_the_router_not_each_worker(
    start_router: StartRouter, sims: list[SimProcess]
) -> None:
    """As many streams as `max_connections` all run on one worker (no per-worker share);
    one more, through the other worker, is refused as `saturated`."""
    limit = 6
    rr = await _start(start_router, sims, serving={"max_connections": limit})
    stream = {**BODY, "max_tokens": 1000, "stream": True}  # ~20 s at 20 ms per token
    async with contextlib.AsyncExitStack() as stack:
        on_0 = [await stack.enter_async_context(_pinned(rr.url, 0)) for _ in range(limit)]
        on_1 = await stack.enter_async_context(_pinned(rr.url, 1))
        responses = [await s.post(rr.url + "/v1/completions", json=stream) for s in on_0]
        assert [r.status for r in responses] == [200] * limit
        for r in responses:
            await r.content.readline()  # every stream is running
        assert rr.router.data_pool_usage()[0] == limit
        async with on_1.post(rr.url + "/v1/completions", json=BODY) as r:
            assert r.status == 503, await r.text()
            assert "saturated" in (await r.json())["error"]["message"]
        for r in responses:
            r.close()  # the clients leave; their engine legs are cancelled
    await eventually(lambda: rr.router.data_pool_usage() == (0, 0), what="every unit back")


async def test_max_connections_bounds_the_routers_open_sockets_idle_ones_included(
    start_router: StartRouter, sims: list[SimProcess]
) -> None:
    """Counted on the engines' side of the real connections: streams through worker 0 leave
    its sockets idle when streams through worker 1 need new ones, and the router as a whole
    never holds more than `max_connections` data sockets (plus the control pool's)."""
    limit, control = 4, 1
    rr = await _start(
        start_router,
        sims,
        serving={"max_connections": limit},
        engine={"control_connections": control},
    )
    ports = {sim.port for sim in sims}
    peak, samples = 0, 0

    async def sample() -> None:
        nonlocal peak, samples
        while True:
            peak = max(peak, accepted_connections(ports))
            samples += 1
            await asyncio.sleep(0.002)

    stream = {**BODY, "max_tokens": 10, "stream": True}
    async with contextlib.AsyncExitStack() as stack:
        waves = [
            [await stack.enter_async_context(_pinned(rr.url, w)) for _ in range(limit)]
            for w in (0, 1, 0, 1)
        ]
        sampler = asyncio.create_task(sample())
        try:
            for wave in waves:  # each wave needs sockets the one before left idle
                async with asyncio.timeout(10):
                    bodies = await asyncio.gather(
                        *(_read(s, rr.url + "/v1/completions", stream) for s in wave)
                    )
                assert all(b.rstrip().endswith(b"data: [DONE]") for b in bodies), bodies
                # A client reads `[DONE]` a moment before its worker frees the request's data
                # connection; the next wave, at the bound, would be `saturated` meanwhile.
                await eventually(lambda: _all_free(rr.url), what="the wave's connections freed")
        finally:
            sampler.cancel()
            await asyncio.gather(sampler, return_exceptions=True)
    assert samples > 50
    assert peak <= limit + control, f"{peak} sockets open to the engines"


async def _all_free(url: str) -> bool:
    """Whether no data connection is in use, router-wide (the control process reads every
    worker's count from the shared table at scrape time)."""
    async with aiohttp.ClientSession() as http:
        text = await _metrics(http, url)
        return metric_sum(text, "narwhal_pool_connections_in_use", pool="data") == 0


async def _read(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> bytes:
    async with session.post(url, json=body) as r:
        assert r.status == 200, await r.text()
        return await r.read()


async def test_metrics_and_admin_read_the_same_through_every_worker(
    start_router: StartRouter, sims: list[SimProcess]
) -> None:
    rr = await _start(start_router, sims)
    n = 30
    async with aiohttp.ClientSession() as http:
        await asyncio.gather(*(http.post(rr.url + "/v1/completions", json=BODY) for _ in range(n)))
    async with _pinned(rr.url, 0) as a, _pinned(rr.url, 1) as b:
        seen = []
        for session in (a, b):
            text = await _metrics(session, rr.url)
            seen.append(metric_sum(text, "narwhal_requests_total", outcome="ok"))
            async with session.get(rr.url + "/admin/engines") as r:
                assert r.status == 200
                assert {e["id"] for e in (await r.json())["engines"]} == {"p0", "p1", "d0"}
        assert seen == [n, n]


async def test_an_operator_drain_holds_on_every_worker_when_it_is_answered(
    start_router: StartRouter, sims: list[SimProcess]
) -> None:
    rr = await _start(start_router, sims)
    async with _pinned(rr.url, 0) as a, _pinned(rr.url, 1) as b:
        async with a.post(rr.url + "/admin/engines/p0/drain", json={"reason": "test"}) as r:
            assert r.status == 200
        sims[0].clear_requests()
        for _ in range(10):
            async with b.post(rr.url + "/v1/completions", json=BODY) as r:
                assert r.status == 200
        assert _client_requests(sims[0]) == []
        async with b.get(rr.url + "/admin/engines") as r:
            p0 = next(e for e in (await r.json())["engines"] if e["id"] == "p0")
        assert "operator_drain" in p0["holds"]


async def test_a_second_router_on_the_same_port_fails_to_start(
    start_router: StartRouter, sims: list[SimProcess], tmp_path: Path
) -> None:
    rr = await _start(start_router, sims)
    port = int(rr.url.rsplit(":", 1)[1])
    other = _RouterProcess(tmp_path, _engines(sims), port=port, workers=2)
    other.start()
    assert other.wait(10) == 1
    assert "another SO_REUSEPORT listener" in other.log()


# --------------------------------------------------------------------------- the control
# process as a child: the test can SIGKILL, SIGSTOP and SIGTERM it.


class _RouterProcess:
    def __init__(
        self, tmp: Path, engines: list[dict[str, Any]], *, port: int, workers: int
    ) -> None:
        config = router_config(engines, tmp, serving={"workers": workers})
        config["listen"] = f"127.0.0.1:{port}"
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        name = f"router-{time.monotonic_ns()}"
        self.config_path = tmp / f"{name}.yaml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.log_path = tmp / f"{name}.log"
        (tmp / "state").mkdir(exist_ok=True)
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, env: dict[str, str] | None = None) -> None:
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "narwhal.cli.serve", "--config", str(self.config_path)],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
            )

    def wait(self, timeout_s: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout_s)

    def log(self) -> str:
        return self.log_path.read_text()

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGCONT)
                self.proc.kill()
            self.proc.wait(10)


@pytest.fixture
def router_process(tmp_path: Path, sims: list[SimProcess]) -> Iterator[_RouterProcess]:
    port = free_port()  # outside the ephemeral range: nothing else takes it before the router
    rp = _RouterProcess(tmp_path, _engines(sims), port=port, workers=2)
    rp.start()
    try:
        yield rp
    finally:
        rp.close()


def _refused(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return False
    except ConnectionRefusedError:
        return True


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # A zombie waiting for its reaper is gone too: it holds no socket.
    with contextlib.suppress(FileNotFoundError):
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    return True


async def _worker_pids(url: str) -> list[int]:
    async with aiohttp.ClientSession() as http:
        await _ready(http, url)
        async with http.get(url + "/admin/workers") as r:
            return [w["pid"] for w in (await r.json())["workers"]]


async def test_killing_the_control_process_closes_the_port_within_a_second(
    router_process: _RouterProcess,
) -> None:
    pids = await _worker_pids(router_process.url)
    assert len(pids) == 2
    router_process.signal(signal.SIGKILL)
    await eventually(lambda: _refused(router_process.port), timeout_s=1.0, what="port closed")
    await eventually(lambda: all(_gone(p) for p in pids), timeout_s=1.0, what="workers gone")


async def test_the_router_bound_bench_names_each_process_of_a_worker_mode_router(
    router_process: _RouterProcess,
) -> None:
    """The bench's CPU per role (docs/benchmarks.md): forked workers keep the zygote's command
    line, and a report that took them for stray children said `one process` of a router
    with two workers."""
    pids = await _worker_pids(router_process.url)
    assert router_process.proc is not None
    roles = {p.pid: p.role for p in router_bound.sample(router_process.proc.pid).procs.values()}
    assert roles.pop(router_process.proc.pid) == "control"
    assert sorted(roles[pid] for pid in pids) == ["worker 0", "worker 1"]
    assert sorted(roles.values()) == ["worker 0", "worker 1", "zygote"]


async def test_a_stopped_control_process_makes_the_workers_refuse(
    router_process: _RouterProcess,
) -> None:
    await _worker_pids(router_process.url)
    url = router_process.url
    router_process.signal(signal.SIGSTOP)
    try:
        async with aiohttp.ClientSession() as http:

            async def refused() -> bool:
                async with http.get(url + "/ready") as r:
                    return r.status == 503 and await r.text() == "control process lost"

            # One monitor interval, at least 2 s (CONTROL_WINDOW_MIN_S), then a margin.
            await eventually(refused, timeout_s=3.5, what="/ready: control process lost")
            async with http.post(url + "/v1/completions", json=BODY) as r:
                assert r.status == 503
                assert "control process lost" in (await r.json())["error"]["message"]
    finally:
        router_process.signal(signal.SIGCONT)
    async with aiohttp.ClientSession() as http:
        await _ready(http, url)


async def test_sigterm_lets_a_running_stream_finish(router_process: _RouterProcess) -> None:
    await _worker_pids(router_process.url)
    url = router_process.url
    stream = {**BODY, "max_tokens": 40, "stream": True}  # ~0.8 s at 20 ms per token
    async with aiohttp.ClientSession() as http:
        async with http.post(url + "/v1/completions", json=stream) as r:
            assert r.status == 200
            await r.content.readline()  # the stream is running
            router_process.signal(signal.SIGTERM)
            await eventually(lambda: _refused(router_process.port), what="port closed")
            body = await r.read()
        assert body.rstrip().endswith(b"data: [DONE]")
    assert router_process.wait(10) == 0


async def test_a_draining_worker_says_draining_for_as_long_as_the_drain_lasts(
    router_process: _RouterProcess,
) -> None:
    """A request whose body is still arriving when SIGTERM comes keeps its connection through
    the drain. When its body ends, well past the control window (2 s), it is refused as
    `draining`: the control process keeps its heartbeats going while the workers drain, so
    they never take it for lost."""
    await _worker_pids(router_process.url)
    body = json.dumps({**BODY, "stream": True}).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", router_process.port)
    try:
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: narwhal\r\nExpect: 100-continue\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
        )
        # The worker answers `100 Continue` from the request's running handler (as it first
        # reads the body): from then on the request is running, which a drain lets finish.
        # Before, the connection is one whose bytes the worker has not read, and a drain
        # closes it as idle.
        async with asyncio.timeout(5):
            assert await reader.readuntil(b"\r\n\r\n") == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(body[:10])
        await writer.drain()
        router_process.signal(signal.SIGTERM)
        await eventually(lambda: _refused(router_process.port), what="draining: port closed")
        # Time itself is what is tested here: the worker's trust in its control process
        # lapses CONTROL_WINDOW_MIN_S after the last heartbeat, so wait out more than that.
        await asyncio.sleep(CONTROL_WINDOW_MIN_S * 1.5)
        writer.write(body[10:])
        await writer.drain()
        async with asyncio.timeout(5):
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(re.search(rb"(?i)content-length: (\d+)", head)[1])  # type: ignore[index]
            answer = json.loads(await reader.readexactly(length))
        assert head.startswith(b"HTTP/1.1 503"), head
        assert "draining: shutting down" in answer["error"]["message"], answer
    finally:
        writer.close()
    assert router_process.wait(10) == 0


# Imported first by every Python process started with its directory on PYTHONPATH (`site`):
# in the zygote, worker 1's start is delayed.
_SLOW_WORKER_1 = """\
import time

if b"narwhal.process.zygote" in open("/proc/self/cmdline", "rb").read().split(b"\\0"):
    from narwhal.process import worker

    _main = worker.main

    def _slow_main(argv):
        if argv[argv.index("--index") + 1] == "1":
            time.sleep({delay_s})
        return _main(argv)

    worker.main = _slow_main
"""


async def test_the_first_worker_to_listen_stays_ready_while_the_other_starts(
    tmp_path: Path, sims: list[SimProcess]
) -> None:
    """Worker 1 starts 3 s late (as on a loaded host); worker 0, listening first, serves alone
    meanwhile and its `/ready` stays 200: the control process's heartbeats run during start-up,
    so worker 0's trust in it (2 s) never lapses into `control process lost`."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(_SLOW_WORKER_1.format(delay_s=3.0))
    path = os.pathsep.join(filter(None, [str(hook), os.environ.get("PYTHONPATH")]))
    rp = _RouterProcess(tmp_path, _engines(sims), port=free_port(), workers=2)
    rp.start(env={**os.environ, "PYTHONPATH": path})
    try:
        async with aiohttp.ClientSession() as http:
            await _ready(http, rp.url)
            alone_since = time.monotonic()

            async def ready_until_worker_1_listens() -> bool:
                async with http.get(rp.url + "/ready") as r:
                    assert (r.status, await r.text()) == (200, "ready")
                return "worker 1 started" in rp.log()

            await eventually(ready_until_worker_1_listens, timeout_s=30, what="worker 1 started")
            alone_s = time.monotonic() - alone_since
            assert alone_s > 1.0, f"worker 0 served alone for {alone_s:.2f} s, not 2 windows"
    finally:
        rp.close()
