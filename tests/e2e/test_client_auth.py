"""Client authentication on `/v1/*` (issue 20 §1), over real `narwhal-sim` engines and the
official `openai` client: keys from an environment variable and from a file (re-read on
reload), 401 in the OpenAI shape without a right key, `/health` and `/ready` open, `/metrics`
open unless `auth.protect_metrics`, and requests counted per key label, never per key."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
import yaml

from tests.support.http import metric
from tests.support.router import RunningRouter, StartRouter, router_config
from tests.support.sim_process import SimFactory, SimProcess

pytestmark = pytest.mark.slow

P = ["--role", "prefill", "--kv-role", "kv_producer"]
D = ["--role", "decode", "--kv-role", "kv_consumer"]
KEYS = "sk-first, sk-second\nsk-third"


def _engines(sims: list[SimProcess]) -> list[dict[str, Any]]:
    return [
        {"id": "p0", "url": sims[0].url, "role": "prefill"},
        {"id": "d0", "url": sims[1].url, "role": "decode"},
    ]


def _label(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:12]


async def _status(http: aiohttp.ClientSession, method: str, url: str, **kw: Any) -> int:
    async with http.request(method, url, **kw) as resp:
        await resp.read()
        return resp.status


async def test_v1_needs_a_known_key_and_the_rest_stays_open(
    sim_factory: SimFactory,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TEST_NARWHAL_KEYS", KEYS)
    sims = sim_factory.start_many([P, D])
    rr = await start_router(_engines(sims), auth={"api_keys_env": "TEST_NARWHAL_KEYS"})
    body = {"model": "demo-model", "prompt": "hi", "max_tokens": 2}
    for headers, why in (({}, "No API key"), ({"Authorization": "Bearer sk-nope"}, "Incorrect")):
        async with http.post(rr.url + "/v1/completions", json=body, headers=headers) as resp:
            assert resp.status == 401
            assert resp.headers["WWW-Authenticate"] == "Bearer"
            error = (await resp.json())["error"]
        assert error["code"] == "invalid_api_key" and why in error["message"]
    assert await _status(http, "GET", rr.url + "/v1/models") == 401
    for path in ("/health", "/ready", "/metrics"):
        assert await _status(http, "GET", rr.url + path) == 200, path

    for key in ("sk-second", "sk-third", "sk-second"):
        async with openai.AsyncOpenAI(base_url=rr.url + "/v1", api_key=key, max_retries=0) as c:
            answer = await c.completions.create(model="demo-model", prompt="hi", max_tokens=2)
            assert answer.choices[0].text
            assert [m.id for m in (await c.models.list()).data] == ["demo-model"]
    async with openai.AsyncOpenAI(base_url=rr.url + "/v1", api_key="sk-wrong", max_retries=0) as c:
        with pytest.raises(openai.AuthenticationError):
            await c.completions.create(model="demo-model", prompt="hi", max_tokens=2)

    counted = "narwhal_client_key_requests_total"
    assert await metric(http, rr.url, counted, key=_label("sk-second")) == 4  # 2 + 2 model lists
    assert await metric(http, rr.url, counted, key=_label("sk-third")) == 2
    async with http.get(rr.url + "/metrics") as resp:
        text = await resp.text()
    assert "sk-second" not in text and "sk-first" not in text
    assert await metric(http, rr.url, "narwhal_requests_total", outcome="unauthorized") == 3


async def test_a_keys_file_is_re_read_on_reload_and_metrics_can_be_protected(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    sims = sim_factory.start_many([P, D])
    keys = tmp_path / "keys"
    keys.write_text("# the clients\nsk-one\n")
    auth = {"api_keys_file": str(keys), "protect_metrics": True}
    config = router_config(_engines(sims), tmp_path, auth=auth, admin={"token": "admin-tok"})
    path = tmp_path / "narwhal.yaml"
    path.write_text(yaml.safe_dump(config))
    rr: RunningRouter = await start_router(
        config["engines"],
        router_kwargs={"config_path": path},
        auth=auth,
        admin={"token": "admin-tok"},
    )
    config["serving"] = {**config["serving"], "workers": rr.router.config.serving.workers}
    path.write_text(yaml.safe_dump(config))
    body = {"model": "demo-model", "prompt": "hi", "max_tokens": 2}
    two = {"Authorization": "Bearer sk-two"}
    assert await _status(http, "POST", rr.url + "/v1/completions", json=body, headers=two) == 401

    keys.write_text("sk-one\nsk-two\n")
    admin = {"Authorization": "Bearer admin-tok"}
    async with http.post(rr.url + "/admin/reload", headers=admin) as resp:
        assert resp.status == 200, await resp.text()
    assert await _status(http, "POST", rr.url + "/v1/completions", json=body, headers=two) == 200

    assert await _status(http, "GET", rr.url + "/metrics") == 401
    assert await _status(http, "GET", rr.url + "/metrics", headers=two) == 200
    assert await _status(http, "GET", rr.url + "/metrics", headers=admin) == 200

    keys.unlink()  # a reload that cannot read the keys is refused and changes nothing
    async with http.post(rr.url + "/admin/reload", headers=admin) as resp:
        assert resp.status == 400
        assert (await resp.json())["error"]["param"] == "auth.api_keys_file"
    assert await _status(http, "POST", rr.url + "/v1/completions", json=body, headers=two) == 200
