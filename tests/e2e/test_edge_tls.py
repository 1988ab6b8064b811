"""HTTPS at both ends (issue 20 §1): the router serves `listen` over TLS with a certificate the
test makes (`openssl`), rotates it on reload without a restart, and reaches `https://`
engines whose certificate chains to `engine.ca_file`."""

from __future__ import annotations

import asyncio
import ssl
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from tests.e2e.test_readmission_support import EngineFront, Pki
from tests.support.router import RunningRouter, StartRouter, router_config
from tests.support.sim_process import SimFactory, SimProcess

pytestmark = pytest.mark.slow

P = ["--role", "prefill", "--kv-role", "kv_producer"]
D = ["--role", "decode", "--kv-role", "kv_consumer"]


def _engines(prefill: str, decode: str) -> list[dict[str, Any]]:
    return [
        {"id": "p0", "url": prefill, "role": "prefill"},
        {"id": "d0", "url": decode, "role": "decode"},
    ]


async def _peer_serial(port: int, ca: Path) -> int:
    """The serial number of the certificate the router presents to a new connection."""
    context = ssl.create_default_context(cafile=str(ca))
    _, writer = await asyncio.open_connection("127.0.0.1", port, ssl=context)
    try:
        sslobj = writer.get_extra_info("ssl_object")
        der = sslobj.getpeercert(binary_form=True)
        info = sslobj.getpeercert()
        assert der and info
        return int(info["serialNumber"], 16)
    finally:
        writer.close()
        await writer.wait_closed()


async def test_the_router_serves_https_and_rotates_its_certificate_on_reload(
    sim_factory: SimFactory, start_router: StartRouter, tmp_path: Path
) -> None:
    sims: list[SimProcess] = sim_factory.start_many([P, D])
    pki = Pki(tmp_path / "pki")
    ca = pki.ca("clients-ca")
    cert, key = pki.issue("clients-ca", "router", ["localhost"], ["127.0.0.1"])
    tls = {"cert_file": str(cert), "key_file": str(key)}
    config = router_config(_engines(sims[0].url, sims[1].url), tmp_path, tls=tls)
    path = tmp_path / "narwhal.yaml"
    path.write_text(yaml.safe_dump(config))
    rr: RunningRouter = await start_router(
        config["engines"], router_kwargs={"config_path": path}, tls=tls
    )
    config["serving"] = {**config["serving"], "workers": rr.router.config.serving.workers}
    path.write_text(yaml.safe_dump(config))
    https = rr.url.replace("http://", "https://")
    port = int(rr.url.rsplit(":", 1)[1])

    context = ssl.create_default_context(cafile=str(ca))
    async with aiohttp.ClientSession() as verified:
        body = {"model": "demo-model", "prompt": "tls", "max_tokens": 3}
        async with verified.post(https + "/v1/completions", json=body, ssl=context) as resp:
            assert resp.status == 200, await resp.text()
            assert (await resp.json())["choices"][0]["text"]
    async with aiohttp.ClientSession() as plain:
        with pytest.raises(aiohttp.ClientError):
            async with plain.get(rr.url + "/health") as resp:
                await resp.read()

    before = await _peer_serial(port, ca)
    pki.issue("clients-ca", "router", ["localhost"], ["127.0.0.1"])  # new files, same paths
    async with aiohttp.ClientSession() as http:
        async with http.post(https + "/admin/reload", ssl=context) as resp:
            assert resp.status == 200, await resp.text()
        after = await _peer_serial(port, ca)
        assert after != before  # every process serves the rotated certificate
        for _ in range(4):  # new connections, whichever worker accepts them
            assert await _peer_serial(port, ca) == after
        async with http.get(https + "/ready", ssl=context) as resp:
            assert resp.status == 200


async def test_https_engines_are_verified_against_engine_ca_file(
    sim_factory: SimFactory, start_router: StartRouter, tmp_path: Path
) -> None:
    sims: list[SimProcess] = sim_factory.start_many([P, D])
    pki = Pki(tmp_path / "pki")
    ca = pki.ca("engines-ca")
    cert, key = pki.issue("engines-ca", "engine", ["localhost"], ["127.0.0.1"])
    fronts = [await EngineFront(s.url, Pki.server_context(cert, key)).start() for s in sims]
    try:
        rr = await start_router(_engines(fronts[0].url, fronts[1].url), engine={"ca_file": str(ca)})
        assert fronts[0].url.startswith("https://")
        async with aiohttp.ClientSession() as http:
            body = {"model": "demo-model", "prompt": "over tls", "max_tokens": 3}
            async with http.post(rr.url + "/v1/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
        assert any(path == "/v1/completions" for _, path in fronts[1].seen)
    finally:
        for front in fronts:
            await front.close()
