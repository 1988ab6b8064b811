"""One request, traceable end to end (issue 20 §2), over real `narwhal-sim` engines.

Every `/v1/*` answer carries `X-Request-Id` (the client's, when printable and at most 128
characters); each engine attempt's id contains it and is unique; `traceparent` and
`tracestate` reach both legs unchanged; the SSE error event names the id; the access log has
one JSON line per request (or one in N); `/metrics` has the process and platform collectors.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import aiohttp
import pytest

from tests.support.router import RunningRouter, StartRouter
from tests.support.sim_process import SimFactory, SimProcess

pytestmark = pytest.mark.slow

P = ["--role", "prefill", "--kv-role", "kv_producer"]
D = ["--role", "decode", "--kv-role", "kv_consumer"]
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
BODY = {"model": "demo-model", "prompt": "trace me", "max_tokens": 4}


async def _router(
    start_router: StartRouter, sims: list[SimProcess], **sections: Any
) -> RunningRouter:
    engines = [
        {"id": "p0", "url": sims[0].url, "role": "prefill"},
        {"id": "d0", "url": sims[1].url, "role": "decode"},
    ]
    return await start_router(engines, **sections)


def _legs(sims: list[SimProcess]) -> list[dict[str, str]]:
    """The headers of every completion leg the engines received, prefill first."""
    return [r["headers"] for sim in sims for r in sim.requests() if r["path"] == "/v1/completions"]


@pytest.mark.parametrize("stream", [False, True])
async def test_a_client_id_is_echoed_and_contained_in_each_attempts_id_with_the_trace(
    stream: bool, sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    sims = sim_factory.start_many([P, D])
    rr = await _router(start_router, sims)
    headers = {"X-Request-Id": "order-42", "traceparent": TRACEPARENT, "tracestate": "k=v"}
    for _ in range(2):  # the same client id twice: attempt ids still differ
        async with http.post(
            rr.url + "/v1/completions", json={**BODY, "stream": stream}, headers=headers
        ) as resp:
            assert resp.status == 200
            assert resp.headers["X-Request-Id"] == "order-42"
            await resp.read()
    legs = _legs(sims)
    assert len(legs) == 4
    ids = [leg["x-request-id"] for leg in legs]
    assert all(i.startswith("order-42-") for i in ids)
    prefill_ids = {leg["x-request-id"] for leg in _legs(sims[:1])}
    assert len(prefill_ids) == 2  # unique per attempt: fresh KV ownership
    assert all(leg["traceparent"] == TRACEPARENT and leg["tracestate"] == "k=v" for leg in legs)


@pytest.mark.parametrize(
    "given",
    ["x" * 129, "bad\u00e9id", "tab\tid", ""],
    ids=["long", "non-ascii", "control", "empty"],
)
async def test_an_unusable_client_id_is_replaced_by_the_routers(
    given: str, sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    sims = sim_factory.start_many([P, D])
    rr = await _router(start_router, sims)
    async with http.post(
        rr.url + "/v1/completions", json=BODY, headers={"X-Request-Id": given}
    ) as resp:
        assert resp.status == 200
        ours = resp.headers["X-Request-Id"]
    assert ours and ours != given and ours.startswith("narwhal-")
    assert _legs(sims)[0]["x-request-id"].startswith(ours)


async def test_errors_carry_the_id_and_the_error_event_names_it(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    sims = sim_factory.start_many([P, [*D, "--itl-ms", "20"]])  # one token per chunk
    rr = await _router(start_router, sims)
    async with http.post(
        rr.url + "/v1/completions", data=b"{", headers={"X-Request-Id": "e1"}
    ) as r:
        assert (r.status, r.headers["X-Request-Id"]) == (400, "e1")
    async with http.post(rr.url + "/v1/completions", json={**BODY, "model": "nope"}) as r:
        assert r.status == 404 and r.headers["X-Request-Id"]
    sims[1].add_fault({"kind": "malformed_event", "leg": "decode", "count": 1, "after_tokens": 2})
    body = {**BODY, "stream": True}
    async with http.post(
        rr.url + "/v1/completions", json=body, headers={"X-Request-Id": "e2"}
    ) as r:
        raw = await r.read()
    assert raw.startswith(b"data: ")  # the stream began, then broke: the router's event
    last = json.loads(raw.strip().split(b"\n\n")[-1].removeprefix(b"data: "))
    assert "(request e2)" in last["error"]["message"]


@pytest.mark.single_process  # the access log is written by the data plane's process
async def test_the_access_log_has_one_line_per_request_or_one_in_n(
    sim_factory: SimFactory,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
    caplog: pytest.LogCaptureFixture,
) -> None:
    sims = sim_factory.start_many([P, D])
    rr = await _router(start_router, sims, logging={"access": True})
    caplog.set_level(logging.INFO, logger="narwhal.access")
    async with http.post(
        rr.url + "/v1/completions", json=BODY, headers={"X-Request-Id": "logged-1"}
    ) as resp:
        assert resp.status == 200
    async with http.post(rr.url + "/v1/completions", data=b"{") as resp:
        assert resp.status == 400
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "narwhal.access"]
    assert len(lines) == 2
    ok, bad = lines
    assert ok["id"] == "logged-1" and ok["endpoint"] == "completions"
    assert (ok["status"], ok["outcome"], ok["model"]) == (200, "ok", "demo-model")
    assert (ok["prefill"], ok["decode"], ok["attempts"], ok["migrations"]) == ("p0", "d0", 1, 0)
    assert ok["duration_s"] > 0 and ok["ttft_s"] is None  # not streamed
    assert ok["completion_tokens"] == 4 and ok["prompt_tokens"] > 0
    assert (bad["status"], bad["outcome"], bad["attempts"]) == (400, "bad_request", 0)

    caplog.clear()
    rr.router.dataplane.reconfigure(
        rr.router.config.model_copy(
            update={"logging": rr.router.config.logging.model_copy(update={"access": "sample:3"})}
        )
    )
    for _ in range(6):
        async with http.post(rr.url + "/v1/completions", json=BODY) as resp:
            assert resp.status == 200
    assert len([r for r in caplog.records if r.name == "narwhal.access"]) == 2


async def test_metrics_have_the_process_and_platform_collectors(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    sims = sim_factory.start_many([P, D])
    rr = await _router(start_router, sims)
    async with http.get(rr.url + "/metrics") as resp:
        text = await resp.text()
    for name in ("process_cpu_seconds_total", "process_resident_memory_bytes", "python_info"):
        assert f"\n{name}" in text, name
