"""Shared helpers for the readmission, admin and CLI end-to-end suites (this module has no tests).

- `Admin`: the router's admin API over HTTP (bearer token optional).
- `EngineFront`: a reverse proxy in front of a narwhal-sim process, run in the test's event
  loop on a loopback port. It lets a test serve an engine over TLS, swap the process behind
  one engine URL (an older process answering where a newer one was), or act at the moment a
  path is requested (add a sim fault between two readmission steps).
- `Pki`: certificate authorities and server certificates made with the `openssl` CLI.
- `RouterProcess`: `narwhal-serve --config FILE` as a child process.
- `assert_failed_at`: the readmission report stops at one failed step, in pipeline order.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from aiohttp import web

from tests.support.poll import eventually
from tests.support.ports import free_port
from tests.support.sim_process import SimProcess

PREFILL = ("--role", "prefill", "--kv-role", "kv_producer")
DECODE = ("--role", "decode", "--kv-role", "kv_consumer")
TOKEN = "s3cret"
STEPS = (
    "health",
    "attestation",
    "model_identity",
    "generation_identity",
    "kv_transfer",
    "final_health",
)
MODEL = "demo-model"


def engine(engine_id: str, url: str, role: str, **extra: Any) -> dict[str, Any]:
    return {"id": engine_id, "url": url, "role": role, **extra}


# --------------------------------------------------------------------------------------------
class Admin:
    """The admin API of one router."""

    def __init__(self, http: aiohttp.ClientSession, url: str, token: str | None = TOKEN) -> None:
        self.http = http
        self.url = url.rstrip("/")
        self.token = token

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    async def get(self, path: str) -> tuple[int, Any]:
        async with self.http.get(self.url + path, headers=self._headers()) as resp:
            return resp.status, await resp.json(content_type=None)

    async def post(self, path: str) -> tuple[int, Any]:
        async with self.http.post(self.url + path, headers=self._headers()) as resp:
            return resp.status, await resp.json(content_type=None)

    async def engines(self) -> list[dict[str, Any]]:
        status, body = await self.get("/admin/engines")
        assert status == 200, body
        engines: list[dict[str, Any]] = body["engines"]
        return engines

    async def engine(self, engine_id: str) -> dict[str, Any]:
        return next(e for e in await self.engines() if e["id"] == engine_id)

    async def drain(self, engine_id: str) -> dict[str, Any]:
        status, body = await self.post(f"/admin/engines/{engine_id}/drain")
        assert status == 200, body
        assert body == {"engine": engine_id, "hold": "operator_drain"}
        return dict(body)

    async def maintenance(self, engine_id: str) -> dict[str, Any]:
        status, body = await self.post(f"/admin/engines/{engine_id}/maintenance")
        assert status == 200, body
        assert body == {"engine": engine_id, "hold": "planned_maintenance"}
        return dict(body)

    async def readmit(self, engine_id: str) -> tuple[int, dict[str, Any]]:
        status, body = await self.post(f"/admin/engines/{engine_id}/readmit")
        return status, body

    async def monitor(self) -> dict[str, Any]:
        status, body = await self.get("/admin/monitor")
        assert status == 200, body
        return dict(body)

    async def wait_passes(self, more: int, timeout_s: float = 20.0) -> None:
        """Wait until the monitor ran `more` further passes."""
        start = (await self.monitor())["passes"]

        async def probe() -> bool:
            return bool((await self.monitor())["passes"] >= start + more)

        await eventually(probe, timeout_s=timeout_s, what=f"{more} more monitor passes")

    async def wait_ready(self, timeout_s: float = 15.0) -> None:
        async def probe() -> bool:
            async with self.http.get(self.url + "/ready") as resp:
                return resp.status == 200

        await eventually(probe, timeout_s=timeout_s, what="/ready 200")

    async def wait_engine(
        self, engine_id: str, check: Callable[[dict[str, Any]], bool], what: str, timeout_s=15.0
    ) -> dict[str, Any]:
        async def probe() -> dict[str, Any] | None:
            e = await self.engine(engine_id)
            return e if check(e) else None

        return await eventually(probe, timeout_s=timeout_s, what=f"{engine_id}: {what}")

    async def metrics(self) -> str:
        async with self.http.get(self.url + "/metrics") as resp:
            assert resp.status == 200
            return await resp.text()


def hold_names(e: dict[str, Any]) -> list[str]:
    return sorted(e["holds"])


def in_service(e: dict[str, Any]) -> bool:
    return bool(e["eligible"] and e["ejected"] is False and not e["holds"])


async def complete(
    http: aiohttp.ClientSession,
    url: str,
    prompt: str = "drains keep traffic away",
    *,
    max_tokens: int = 4,
    stream: bool = False,
) -> tuple[int, bytes]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": stream}
    async with http.post(url + "/v1/completions", json=body) as resp:
        return resp.status, await resp.read()


def two_prefill(p0: SimProcess, p1: SimProcess, d0: SimProcess) -> list[dict[str, Any]]:
    return [
        engine("p0", p0.url, "prefill"),
        engine("p1", p1.url, "prefill"),
        engine("d0", d0.url, "decode"),
    ]


# Prefill engines whose prefill takes ~100 ms: a burst of concurrent requests is spread over
# every eligible prefill engine by least-in-flight placement, whatever the tie rotation does.
SLOW_PREFILL = (*PREFILL, "--ttft-per-token-ms", "20")


def prefill_legs(sim: SimProcess) -> int:
    return sum(1 for r in sim.requests() if r["leg"] == "prefill")


async def send(http: aiohttp.ClientSession, url: str, n: int) -> None:
    """`n` requests one after another."""
    for i in range(n):
        status, raw = await complete(http, url, f"request number {i} goes somewhere")
        assert status == 200, raw


async def burst(http: aiohttp.ClientSession, url: str, n: int = 6) -> None:
    """`n` concurrent requests."""
    results = await asyncio.gather(
        *(complete(http, url, f"burst request {i} of the test") for i in range(n))
    )
    assert [s for s, _ in results] == [200] * n, results


async def burst_share(
    http: aiohttp.ClientSession, url: str, sims: list[SimProcess], n: int = 6
) -> list[int]:
    """Prefill legs each sim got from one burst of `n` concurrent requests."""
    for sim in sims:
        await asyncio.to_thread(sim.clear_requests)
    await burst(http, url, n)
    return [await asyncio.to_thread(prefill_legs, sim) for sim in sims]


def assert_failed_at(steps: list[dict[str, Any]], name: str, reason_part: str) -> dict[str, Any]:
    """The report is exactly the pipeline up to the failed step `name`: every earlier step is
    present, in order, and passed (or was not configured); the last one failed; nothing after.
    """
    names = [s["step"] for s in steps]
    assert name in STEPS, name
    expected = list(STEPS[: STEPS.index(name) + 1])
    assert names == expected, f"expected the steps {expected}, got {names}: {steps}"
    *before, last = steps
    for s in before:
        assert s["ok"] is True and s["status"] in ("passed", "not_configured"), s
    assert last["step"] == name, f"expected the report to stop at {name}: {steps}"
    assert last["ok"] is False and last["status"] == "failed", last
    assert reason_part in last["reason"], last
    assert set(last) == {"step", "ok", "status", "reason"}, last
    return last


# --------------------------------------------------------------------------------------------
class EngineFront:
    """A reverse proxy for one engine URL; optionally TLS; `upstream` may change at any time.

    `before[path]`: an async callable run once (then forgotten) before that path is forwarded.
    `answer[path]`: a status answered instead of forwarding (an empty body).
    """

    def __init__(self, upstream: str, ssl_context: ssl.SSLContext | None = None) -> None:
        self.upstream = upstream
        self.ssl_context = ssl_context
        self.before: dict[str, Callable[[], Awaitable[None]]] = {}
        self.answer: dict[str, int] = {}
        self.seen: list[tuple[str, str]] = []
        self.url = ""
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    async def start(self, port: int = 0) -> EngineFront:
        """Listen on `port` (0: any free one); again after `close`, to look like a restart."""
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", port, ssl_context=self.ssl_context)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"{'https' if self.ssl_context else 'http'}://127.0.0.1:{port}"
        self._session = aiohttp.ClientSession(auto_decompress=False)
        return self

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
        if self._runner is not None:
            await self._runner.cleanup()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.seen.append((request.method, request.path))
        if request.path in self.answer:
            return web.Response(status=self.answer[request.path])
        hook = self.before.pop(request.path, None)
        if hook is not None:
            await hook()
        assert self._session is not None
        headers = {
            k: v
            for k, v in request.headers.items()
            if k.lower() in ("content-type", "authorization", "x-request-id", "accept")
        }
        data = await request.read()
        resp = web.StreamResponse(status=502)
        try:
            async with self._session.request(
                request.method, self.upstream + request.path_qs, data=data, headers=headers
            ) as up:
                resp.set_status(up.status)
                if "Content-Type" in up.headers:
                    resp.headers["Content-Type"] = up.headers["Content-Type"]
                await resp.prepare(request)
                async for chunk in up.content.iter_any():
                    await resp.write(chunk)
                await resp.write_eof()
        except (aiohttp.ClientError, ConnectionError):
            # The upstream went away (502 if nothing was sent yet) or the client left.
            if not resp.prepared:
                return web.Response(status=502)
        return resp


# --------------------------------------------------------------------------------------------
class Pki:
    """Test certificate authorities and server certificates (the `openssl` CLI)."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self._serial = int(time.time() * 1000)

    def _openssl(self, *args: str) -> None:
        done = subprocess.run(
            ["openssl", *args], cwd=self.dir, capture_output=True, text=True, check=False
        )
        assert done.returncode == 0, f"openssl {' '.join(args)}: {done.stderr}"

    def ca(self, name: str) -> Path:
        """A self-signed CA: `<name>.pem` (and its key `<name>.key`)."""
        self._openssl(
            "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
            "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "2",
            "-subj", f"/CN=narwhal test {name}",
            "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        )  # fmt: skip
        return self.dir / f"{name}.pem"

    def issue(self, ca: str, name: str, dns: list[str], ips: list[str]) -> tuple[Path, Path]:
        """A server certificate signed by `ca` naming `dns` and `ips`; returns (cert, key)."""
        self._serial += 1
        san = ",".join([*(f"DNS:{d}" for d in dns), *(f"IP:{i}" for i in ips)])
        ext = self.dir / f"{name}.ext"
        ext.write_text(
            f"subjectAltName={san}\n"
            "basicConstraints=critical,CA:FALSE\n"
            "keyUsage=critical,digitalSignature,keyEncipherment\n"
            "extendedKeyUsage=serverAuth\n"
            "authorityKeyIdentifier=keyid\n"
            "subjectKeyIdentifier=hash\n"
        )
        self._openssl(
            "req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
            "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}",
        )  # fmt: skip
        self._openssl(
            "x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
            "-set_serial", str(self._serial), "-days", "2", "-out", f"{name}.pem",
            "-extfile", str(ext),
        )  # fmt: skip
        return self.dir / f"{name}.pem", self.dir / f"{name}.key"

    @staticmethod
    def server_context(cert: Path, key: Path) -> ssl.SSLContext:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(cert, key)
        return ctx


# --------------------------------------------------------------------------------------------
class RouterProcess:
    """`narwhal-serve --config FILE` as a child process on a free loopback port."""

    def __init__(self, config: dict[str, Any], directory: Path, env: dict[str, str]) -> None:
        self.port = free_port()
        self.config = {**config, "listen": f"127.0.0.1:{self.port}"}
        self.dir = directory
        self.env = {**os.environ, **env}
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = directory / "narwhal-serve.log"
        self._proc: asyncio.subprocess.Process | None = None

    async def start(self, timeout_s: float = 20.0) -> RouterProcess:
        path = self.dir / "narwhal.yaml"
        path.write_text(yaml.safe_dump(self.config))
        with self.log.open("wb") as log:
            self._proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "narwhal.cli.serve", "--config", str(path),
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=self.env,
            )  # fmt: skip

        async def up() -> bool:
            assert self._proc is not None
            if self._proc.returncode is not None:
                raise AssertionError(f"narwhal-serve exited: {self.log.read_text()[-3000:]}")
            try:
                async with aiohttp.ClientSession() as s, s.get(self.url + "/health") as resp:
                    return resp.status == 200
            except aiohttp.ClientError:
                return False

        await eventually(up, timeout_s=timeout_s, interval_s=0.1, what="narwhal-serve /health")
        return self

    async def stop(self) -> None:
        proc = self._proc
        if proc is None or proc.returncode is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            async with asyncio.timeout(10):
                await proc.wait()
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()


def metric(text: str, name: str, **labels: str) -> float:
    """One sample's value from Prometheus text (0 when absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return 0.0
