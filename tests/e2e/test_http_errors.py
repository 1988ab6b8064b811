"""aiohttp's own errors on the router's API paths come in the OpenAI error shape.

An unknown path (404), a wrong method (405) and an unexpected exception (500) would otherwise
be aiohttp's plain text, which OpenAI clients cannot parse. Real router on a loopback socket;
its engines are unreachable ports (nothing here reaches an engine).
"""

from __future__ import annotations

from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from tests.support.router import RunningRouter, StartRouter

TOKEN = "s3cret-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
OFFLINE = [
    {"id": "p0", "url": "http://127.0.0.1:9", "role": "prefill"},
    {"id": "d0", "url": "http://127.0.0.1:7", "role": "decode"},
]


@pytest.fixture
async def rr(start_router: StartRouter) -> RunningRouter:
    return await start_router(OFFLINE, admin={"token": TOKEN})


async def _call(
    http: aiohttp.ClientSession,
    method: str,
    url: str,
    headers: dict[str, str] | None = None,
) -> tuple[aiohttp.ClientResponse, bytes]:
    async with http.request(method, url, headers=headers, json=None) as resp:
        return resp, await resp.read()


def _openai_error(resp: aiohttp.ClientResponse, body: bytes, status: int, type_: str) -> Any:
    assert resp.status == status, body
    assert resp.content_type == "application/json", (resp.content_type, body)
    doc = orjson.loads(body)
    assert set(doc) == {"error"}
    assert set(doc["error"]) == {"message", "type", "param", "code"}
    assert doc["error"]["type"] == type_
    assert doc["error"]["code"] == status
    assert isinstance(doc["error"]["message"], str) and doc["error"]["message"]
    return doc["error"]


@pytest.mark.parametrize(
    ("method", "path", "status", "type_"),
    [
        ("GET", "/v1/completions", 405, "invalid_request_error"),
        ("GET", "/v1/chat/completions", 405, "invalid_request_error"),
        ("POST", "/v1/models", 405, "invalid_request_error"),
        ("POST", "/v1/audio/speech", 404, "not_found_error"),
        ("GET", "/v1/embeddings", 405, "invalid_request_error"),
        ("GET", "/v1/nothing/here", 404, "not_found_error"),
    ],
)
async def test_v1_routing_errors_are_openai_shaped(
    rr: RunningRouter,
    http: aiohttp.ClientSession,
    method: str,
    path: str,
    status: int,
    type_: str,
) -> None:
    resp, body = await _call(http, method, rr.url + path)
    error = _openai_error(resp, body, status, type_)
    assert path in error["message"]
    if status == 405:
        assert resp.headers["Allow"], "a 405 names the allowed methods"


@pytest.mark.single_process  # patches this process's data plane
async def test_an_unexpected_exception_on_v1_is_an_openai_shaped_500(
    rr: RunningRouter, http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def broken(kind: str, request: web.Request) -> web.StreamResponse:
        raise RuntimeError("a bug")

    monkeypatch.setattr(rr.router.dataplane, "handle", broken)
    body = {"model": "demo-model", "prompt": "hi", "max_tokens": 1}
    async with http.post(rr.url + "/v1/completions", json=body) as resp:
        raw = await resp.read()
    error = _openai_error(resp, raw, 500, "server_error")
    assert "a bug" not in error["message"]  # internals stay in the log


async def test_admin_errors_are_json_and_need_the_token_first(
    rr: RunningRouter, http: aiohttp.ClientSession
) -> None:
    resp, body = await _call(http, "GET", rr.url + "/admin/nothing", AUTH)
    _openai_error(resp, body, 404, "not_found_error")
    resp, body = await _call(http, "DELETE", rr.url + "/admin/engines", AUTH)
    _openai_error(resp, body, 405, "invalid_request_error")
    # Without the token every admin path is 401 before any 404 or 405, in the same shape.
    for method, path in [("GET", "/admin/engines"), ("GET", "/admin/nothing")]:
        resp, body = await _call(http, method, rr.url + path)
        _openai_error(resp, body, 401, "unauthorized")
    resp, body = await _call(http, "DELETE", rr.url + "/admin/engines")
    _openai_error(resp, body, 401, "unauthorized")


async def test_plain_text_endpoints_keep_their_answers(
    rr: RunningRouter, http: aiohttp.ClientSession
) -> None:
    resp, body = await _call(http, "GET", rr.url + "/health")
    assert (resp.status, body) == (200, b"ok")
    resp, body = await _call(http, "GET", rr.url + "/no-such-page")
    assert resp.status == 404 and resp.content_type == "text/plain"
