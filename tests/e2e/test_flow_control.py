"""Flow control end to end (DESIGN §13, docs/flow.md): real sims, a real router in one process
or with two workers, the official `openai` client. Saturation keeps requests waiting in the
router, in priority order; a full queue and a key's rate limit answer 429 with Retry-After;
the client's retries converge; a worker killed while requests wait leaks no slot; a router
that stops admitting answers every waiting request 503 at once; a key's tokens per minute end
in 429 with the `-tokens` headers, another key unaffected; `/admin/flow` and `narwhal status`
show the waiting queue."""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import time
from typing import Any

import aiohttp
import openai
import pytest

from tests.support.cli import narwhal
from tests.support.poll import eventually
from tests.support.router import RunningRouter, StartRouter
from tests.support.sim_process import SimFactory

P = ["--role", "prefill", "--kv-role", "kv_producer"]
D = ["--role", "decode", "--kv-role", "kv_consumer"]
WORKERS = pytest.mark.parametrize("workers", [1, 2])


def _engines(sims: list[Any], limit: int) -> list[dict[str, Any]]:
    return [
        {"id": "p0", "url": sims[0].url, "role": "prefill", "max_concurrency": limit},
        {"id": "d0", "url": sims[1].url, "role": "decode", "max_concurrency": limit},
    ]


async def _router(
    sim_factory: SimFactory,
    start_router: StartRouter,
    workers: int,
    limit: int,
    itl_ms: int = 40,
    **sections: Any,
) -> RunningRouter:
    cap = ["--max-concurrency", str(limit)]
    sims = sim_factory.start_many([[*P, *cap], [*D, *cap, "--itl-ms", str(itl_ms)]])
    serving = {"policy": "bounded", "workers": workers, **sections.pop("serving", {})}
    rr = await start_router(_engines(sims, limit), serving=serving, **sections)
    await rr.ready()
    return rr


async def _post(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any], **kw: Any
) -> tuple[int, dict[str, str], Any]:
    async with http.post(url + "/v1/completions", json=body, **kw) as resp:
        return resp.status, dict(resp.headers), await resp.json()


def _body(prompt: str, **kw: Any) -> dict[str, Any]:
    return {"model": "demo-model", "prompt": prompt, "max_tokens": 6, **kw}


@WORKERS
async def test_saturation_keeps_requests_waiting_in_the_router_not_the_engine(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession, workers: int
) -> None:
    # The sims refuse (429) past 2 requests: every request answered 200 was never piled
    # onto an engine past its limit.
    rr = await _router(sim_factory, start_router, workers, limit=2)
    tasks = [asyncio.create_task(_post(http, rr.url, _body(f"r{i}"))) for i in range(10)]
    waited = await eventually(
        lambda: rr.router.flow.state.waiting() >= 3, timeout_s=10, what="requests waiting"
    )
    assert waited
    answers = await asyncio.gather(*tasks)
    assert [status for status, _, _ in answers] == [200] * 10
    assert rr.router.flow.state.waiting() == 0
    # A request's end reaches the queue after its answer (a worker's `done` crosses the
    # channel once the client has it): every grant is given back, soon.
    await eventually(lambda: len(rr.router.flow.state) == 0, what="every grant given back")
    async with http.get(rr.url + "/metrics") as resp:
        text = await resp.text()
    assert 'narwhal_queue_wait_seconds_count{priority="0"}' in text
    assert 'narwhal_queue_depth{priority="0"} 0.0' in text


@WORKERS
async def test_under_saturation_a_lower_priority_number_starts_first(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession, workers: int
) -> None:
    rr = await _router(sim_factory, start_router, workers, limit=1, itl_ms=60)
    finished: list[str] = []

    async def one(name: str, priority: int) -> None:
        status, _, _ = await _post(http, rr.url, _body(name, priority=priority))
        assert status == 200
        finished.append(name)

    blocker = asyncio.create_task(one("blocker", 0))
    await eventually(lambda: len(rr.router.flow.state) == 1, what="the blocker started")
    low = [asyncio.create_task(one(f"low{i}", 5)) for i in range(3)]
    await eventually(lambda: rr.router.flow.state.waiting() == 3, what="three low waiting")
    high = asyncio.create_task(one("high", 0))
    await eventually(lambda: rr.router.flow.state.waiting() == 4, what="high waiting")
    await asyncio.gather(blocker, *low, high)
    assert finished[:2] == ["blocker", "high"], finished


@WORKERS
async def test_a_full_queue_sheds_with_429_and_retry_after_never_a_5xx(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession, workers: int
) -> None:
    rr = await _router(sim_factory, start_router, workers, limit=1, flow={"queue_limit": 2})
    answers = await asyncio.gather(*(_post(http, rr.url, _body(f"r{i}")) for i in range(8)))
    statuses = sorted(status for status, _, _ in answers)
    assert set(statuses) == {200, 429}, statuses
    assert statuses.count(200) >= 3  # one running and two waiting at least
    for status, headers, body in answers:
        if status == 429:
            assert int(headers["Retry-After"]) >= 1
            assert body["error"]["code"] == "rate_limit_exceeded"
            assert "queue is full" in body["error"]["message"]
    async with http.get(rr.url + "/metrics") as resp:
        text = await resp.text()
    assert f'narwhal_shed_total{{reason="queue_full"}} {statuses.count(429)}.0' in text


def _label(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:12]


@WORKERS
async def test_a_keys_requests_per_minute_answer_429_with_openai_rate_limit_headers(
    sim_factory: SimFactory,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
    monkeypatch: pytest.MonkeyPatch,
    workers: int,
) -> None:
    monkeypatch.setenv("TEST_FLOW_KEYS", "sk-limited\nsk-free")
    auth = {
        "api_keys_env": "TEST_FLOW_KEYS",
        "key_policies": {_label("sk-limited"): {"requests_per_minute": 2}},
    }
    rr = await _router(sim_factory, start_router, workers, limit=8, auth=auth)
    limited = {"Authorization": "Bearer sk-limited"}
    first = await _post(http, rr.url, _body("a"), headers=limited)
    assert first[0] == 200
    assert first[1]["x-ratelimit-limit-requests"] == "2"
    assert first[1]["x-ratelimit-remaining-requests"] == "1"
    assert (await _post(http, rr.url, _body("b"), headers=limited))[0] == 200
    status, headers, body = await _post(http, rr.url, _body("c"), headers=limited)
    assert status == 429
    assert body["error"]["code"] == "rate_limit_exceeded" and body["error"]["type"] == "requests"
    assert int(headers["Retry-After"]) == 30  # one request back, at 2 a minute
    assert headers["x-ratelimit-remaining-requests"] == "0"
    assert headers["x-ratelimit-reset-requests"].endswith("s")
    # Another key is not limited.
    free = {"Authorization": "Bearer sk-free"}
    assert (await _post(http, rr.url, _body("d"), headers=free))[0] == 200
    async with http.get(rr.url + "/metrics") as resp:
        text = await resp.text()
    assert 'narwhal_shed_total{reason="requests_per_minute"} 1.0' in text
    assert f'narwhal_client_tokens_total{{key="{_label("sk-limited")}"}}' in text


@WORKERS
async def test_the_openai_client_retries_429s_and_converges(
    sim_factory: SimFactory, start_router: StartRouter, workers: int
) -> None:
    rr = await _router(
        sim_factory, start_router, workers, limit=1, itl_ms=20, flow={"queue_limit": 1}
    )
    async with openai.AsyncOpenAI(base_url=rr.url + "/v1", api_key="x", max_retries=8) as c:
        raw = c.completions.with_raw_response

        async def one(i: int) -> int:
            reply = await raw.create(model="demo-model", prompt=f"p{i}", max_tokens=4)
            assert reply.parse().choices[0].text
            return reply.retries_taken

        retries = await asyncio.gather(*(one(i) for i in range(6)))
    assert sum(retries) > 0, "nothing was shed: the test did not overload the router"
    shed = rr.router.metrics.flow.shed.labels("queue_full")._value.get()
    assert shed == sum(retries)


@pytest.mark.parametrize("workers", [2])
async def test_a_worker_killed_while_requests_wait_leaks_no_slot(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession, workers: int
) -> None:
    rr = await _router(sim_factory, start_router, workers, limit=1, itl_ms=60)
    sup = rr.router.supervisor
    assert sup is not None
    state = rr.router.flow.state
    tasks = [asyncio.create_task(_post(http, rr.url, _body(f"r{i}"))) for i in range(8)]
    await eventually(lambda: state.waiting() >= 4, what="requests waiting")
    victim = sup.workers[0]
    assert victim.pid is not None
    os.kill(victim.pid, signal.SIGKILL)
    results = await asyncio.gather(*tasks, return_exceptions=True)
    served = [r for r in results if isinstance(r, tuple)]
    lost = [r for r in results if not isinstance(r, tuple)]
    assert all(status == 200 for status, _, _ in served), served
    assert all(isinstance(e, aiohttp.ClientError) for e in lost), lost
    await eventually(lambda: len(state) == 0, what="nothing held for the dead worker")
    assert state.unplaced("demo-model", "prefill") == 0
    # Later requests still start: no slot is held by the dead worker's grants.
    await eventually(lambda: victim.running, timeout_s=15, what="the worker restarted")
    again = await asyncio.gather(*(_post(http, rr.url, _body(f"s{i}")) for i in range(3)))
    assert [status for status, _, _ in again] == [200] * 3


@WORKERS
async def test_a_router_that_stops_admitting_answers_every_waiting_request_503_at_once(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession, workers: int
) -> None:
    rr = await _router(sim_factory, start_router, workers, limit=1, itl_ms=200)
    state = rr.router.flow.state
    tasks = [asyncio.create_task(_post(http, rr.url, _body(f"r{i}"))) for i in range(6)]
    await eventually(lambda: state.waiting() == 5, what="five waiting")
    closed_at = time.monotonic()
    # Closed under an owner of the test's own: closed as "monitor", the monitor's next pass
    # (healthy engines) reopened it, and on a loaded machine that pass could come before the
    # queue's next tick, which then found admission open and served all five.
    rr.router.admission.close("test", "degraded: test")
    answers = await asyncio.gather(*tasks)
    refused = [a for a in answers if a[0] == 503]
    assert len(refused) == 5 and sum(a[0] == 200 for a in answers) == 1
    for _, headers, body in refused:
        assert headers["Retry-After"] == "1"
        assert body["error"]["message"] == "not admitting requests: degraded: test"
    # At once: well before the running request's own end would have freed a slot for them.
    assert time.monotonic() - closed_at < 5.0


@WORKERS
async def test_the_admin_flow_document_and_narwhal_status_show_the_waiting_queue(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession, workers: int
) -> None:
    rr = await _router(sim_factory, start_router, workers, limit=1, itl_ms=100)

    async def document(path: str = "/admin/flow") -> Any:
        async with http.get(rr.url + path) as resp:
            assert resp.status == 200
            return await resp.json()

    # The blocker runs 6 s: the queue behind it stays while the CLI starts and reads it.
    blocker = asyncio.create_task(_post(http, rr.url, _body("blocker", max_tokens=60)))
    await eventually(lambda: len(rr.router.flow.state) == 1, what="the blocker started")
    tasks = [
        asyncio.create_task(_post(http, rr.url, _body(f"r{i}", priority=p)))
        for i, p in enumerate([0, 0, 3])
    ]

    seen: list[Any] = []

    async def three_waiting() -> Any:
        doc = await document()
        seen.append(doc)
        return doc if doc["waiting"] == 3 else None

    try:
        doc = await eventually(three_waiting, what="three waiting in /admin/flow")
    except AssertionError as exc:  # once, on a loaded run, with workers: say what was seen
        done = [t.done() for t in (blocker, *tasks)]
        raise AssertionError(f"{exc}; last documents {seen[-2:]}; answered {done}") from None
    assert doc["enabled"] is True and doc["running"] == 1
    assert [(p["priority"], p["waiting"]) for p in doc["priorities"]] == [(0, 2), (3, 1)]
    assert all(p["oldest_wait_s"] > 0 for p in doc["priorities"])
    assert doc["refused"]["queue_full"] == 0
    dashboard = await document("/admin/dashboard")
    assert dashboard["flow"]["waiting"] == 3
    status = await narwhal("--url", rr.url, "status")
    assert status.code == 0, status
    lines = status.out.splitlines()
    flow = [line for line in lines if line.startswith("flow:")]
    assert len(flow) == 1 and flow[0].startswith("flow: on, 3 waiting of 1024 (oldest "), lines
    assert flow[0].endswith(", 1 running"), flow
    assert any(line.startswith("  priority 0: 2 waiting, oldest ") for line in lines), lines
    assert any(line.startswith("  priority 3: 1 waiting, oldest ") for line in lines), lines
    answers = await asyncio.gather(blocker, *tasks)
    assert [a[0] for a in answers] == [200] * 4
    after = await document()
    assert after["waiting"] == 0 and after["priorities"] == [] and after["oldest_wait_s"] is None


@WORKERS
async def test_a_keys_tokens_per_minute_answer_429_with_the_tokens_headers_after_its_budget(
    sim_factory: SimFactory,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
    monkeypatch: pytest.MonkeyPatch,
    workers: int,
) -> None:
    monkeypatch.setenv("TEST_FLOW_KEYS", "sk-small\nsk-other")
    budget = 30  # tokens a minute: a few requests of 6 output tokens and a short prompt
    auth = {
        "api_keys_env": "TEST_FLOW_KEYS",
        "key_policies": {_label("sk-small"): {"tokens_per_minute": budget}},
    }
    rr = await _router(sim_factory, start_router, workers, limit=8, auth=auth)
    small = {"Authorization": "Bearer sk-small"}
    served: list[dict[str, str]] = []
    refused = None
    for i in range(budget):  # each takes at least its max_tokens: the budget ends well before
        status, headers, body = await _post(http, rr.url, _body(f"t{i}"), headers=small)
        if status != 200:
            refused = (status, headers, body)
            break
        served.append(headers)
    assert served, "the key's first request was refused"
    assert refused is not None, "the key was never limited"
    assert served[0]["x-ratelimit-limit-tokens"] == str(budget)
    remaining = [int(h["x-ratelimit-remaining-tokens"]) for h in served]
    assert remaining == sorted(remaining, reverse=True) and remaining[0] < budget, remaining
    # Only the limit the key has.
    assert "x-ratelimit-limit-requests" not in {k.lower() for k in served[0]}
    status, headers, body = refused
    assert status == 429, refused
    assert body["error"]["code"] == "rate_limit_exceeded" and body["error"]["type"] == "tokens"
    assert body["error"]["message"].startswith("Rate limit reached for tokens per minute")
    assert int(headers["Retry-After"]) >= 1
    assert headers["x-ratelimit-limit-tokens"] == str(budget)
    assert int(headers["x-ratelimit-remaining-tokens"]) < 6 + 1  # less than the request needs
    assert headers["x-ratelimit-reset-tokens"].endswith("s")
    # A request larger than the key's whole minute can never pass: no Retry-After.
    status, headers, body = await _post(
        http, rr.url, _body("big", max_tokens=budget + 1), headers=small
    )
    assert status == 429 and "retry-after" not in {k.lower() for k in headers}, headers
    assert body["error"]["message"].startswith("Request too large"), body
    # Another key is not limited.
    other = {"Authorization": "Bearer sk-other"}
    for i in range(3):
        assert (await _post(http, rr.url, _body(f"o{i}"), headers=other))[0] == 200
    async with http.get(rr.url + "/metrics") as resp:
        text = await resp.text()
    assert 'narwhal_shed_total{reason="tokens_per_minute"} 2.0' in text
    async with http.get(rr.url + "/admin/flow") as resp:
        flow = await resp.json()
    assert flow["refused_by_key"] == {_label("sk-small"): {"tokens_per_minute": 2}}, flow
    assert flow["refused"]["tokens_per_minute"] == 2
    assert flow["served_tokens"][_label("sk-small")] == 6 * len(served), flow


@WORKERS
async def test_with_flow_control_off_a_full_fleet_answers_503_at_once(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession, workers: int
) -> None:
    """DESIGN §13: under `single_attempt` (flow control off) a full fleet answers 503 at once,
    nothing sent to an engine past `engines[].max_concurrency`; once the slot frees, the next
    request is served."""
    prefill, decode = sim_factory.start_many([P, [*D, "--itl-ms", "100"]])
    rr = await start_router(_engines([prefill, decode], 1), serving={"workers": workers})
    await rr.ready()
    running = asyncio.create_task(_post(http, rr.url, _body("running", max_tokens=30)))
    await eventually(lambda: len(decode.requests()) == 1, what="the first request decoding")
    started = time.monotonic()
    status, headers, body = await _post(http, rr.url, _body("second"))
    assert status == 503 and headers["Retry-After"] == "1", body
    assert body["error"]["message"] == "server saturated: every eligible decode engine is full"
    assert time.monotonic() - started < 2.0  # at once, not after the running one's 3 s
    assert len(prefill.requests()) == 1, "no prefill spent on a request no decode could take"
    assert (await running)[0] == 200
    assert (await _post(http, rr.url, _body("third")))[0] == 200


@pytest.mark.single_process  # reads the data plane's view of the engines' scraped load
async def test_with_flow_control_off_engines_full_by_their_own_queue_answer_503_at_once(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    """DESIGN §13's other measure of full: the engine's scraped `vllm:num_requests_waiting`
    past `flow.engine_waiting_max` (default 8). With every prefill engine that full, a
    request is answered 503 at once instead of joining the engine's queue."""
    slow = [*P, "--max-num-seqs", "1", "--ttft-per-token-ms", "40"]
    prefill, decode = sim_factory.start_many([slow, D])
    engines = [
        {"id": "p0", "url": prefill.url, "role": "prefill"},
        {"id": "d0", "url": decode.url, "role": "decode"},
    ]
    placement = {"policy": "prefix", "metrics_interval_s": 0.1, "metrics_stale_s": 2.0}
    rr = await start_router(engines, placement=placement)
    await rr.ready()
    queued = [asyncio.create_task(_post(http, rr.url, _body(f"queued {i}"))) for i in range(12)]
    loads = rr.router.dataplane.prefix

    def p0_past_its_bound() -> bool:
        load = loads.loads.get("p0")
        return load is not None and load.waiting > 8

    await eventually(p0_past_its_bound, what="p0's scraped queue past 8")
    started = time.monotonic()
    status, headers, body = await _post(http, rr.url, _body("one more"))
    assert status == 503 and headers["Retry-After"] == "1", body
    assert body["error"]["message"] == "server saturated: every eligible prefill engine is full"
    assert time.monotonic() - started < 1.0
    assert all(answer[0] == 200 for answer in await asyncio.gather(*queued))


@WORKERS
async def test_a_stream_without_usage_counts_the_tokens_it_delivered(
    sim_factory: SimFactory,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
    monkeypatch: pytest.MonkeyPatch,
    workers: int,
) -> None:
    """A streamed answer whose client did not ask for `include_usage` carries no usage event;
    its key is charged the tokens the stream delivered (counted by the stream's splice), not
    left holding the whole reservation (prompt plus `max_tokens`)."""
    monkeypatch.setenv("TEST_FLOW_KEYS", "sk-stream")
    auth = {
        "api_keys_env": "TEST_FLOW_KEYS",
        "key_policies": {_label("sk-stream"): {"tokens_per_minute": 1000}},
    }
    rr = await _router(sim_factory, start_router, workers, limit=8, auth=auth)
    body = _body("a stream", max_tokens=7, stream=True)
    headers = {"Authorization": "Bearer sk-stream"}
    async with http.post(rr.url + "/v1/completions", json=body, headers=headers) as resp:
        assert resp.status == 200
        events = [line for line in (await resp.read()).split(b"\n\n") if line]
    assert events[-1] == b"data: [DONE]" and not any(b'"usage"' in e for e in events)

    async def served() -> int | None:
        async with http.get(rr.url + "/admin/flow") as resp:
            tokens = (await resp.json())["served_tokens"].get(_label("sk-stream"))
        return tokens if isinstance(tokens, int) else None

    assert await eventually(served, what="the key's served tokens") == 7
