"""A takeover while flow control's queue is full (issue 31, "Done when"; docs/flow.md "Wiring"):
two real router processes over a real lease backend (a shared lease file, or a real etcd), a
real fleet of sims whose `max_concurrency` is 1, so requests wait in the active's queue.

The active is frozen (SIGSTOP) with its queue full; the standby takes over the lease and
starts with an empty queue; the frozen router, resumed, judges its lease lost on its own
monotonic clock and answers every request it held with 503 and `Retry-After` at once, long
before the request it was running would have freed a slot, and starts none of them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.e2e.test_lease_failover import Pair, RouterProcess, Timings, _wait_ready, running_pair
from tests.support.poll import eventually
from tests.support.sim_process import SimFactory

pytestmark = pytest.mark.slow

QUEUE_LIMIT = 3
ITL_MS = 100
BLOCKER_TOKENS = 150  # the running request takes 15 s: the queue behind it stays full
AT_ONCE_S = 1.0  # resumed -> every waiting request answered (the flow tick is 50 ms)
# A longer lease than the failover scenarios' (2 s): this scenario is about the queue, not
# the lease's bounds, and with a 2 s TTL the active judged its own lease lost before the
# scenario began whenever a renewal took over 1.1 s, which a loaded 2-core host gave it
# twice (a standby starting its workers beside another test's processes): the lease doing
# its job, at a TTL no production lease has. The blocker runs past the longer takeover.
T = Timings(ttl_s=4.0)


def _engines(sim_factory: SimFactory) -> list[dict[str, Any]]:
    # The limit is each router's own (`max_concurrency`), not the sims': the new active,
    # which does not count what the old one runs, is served while the old one's request runs.
    p0, d0 = sim_factory.start_many(
        [["--role", "prefill", "--kv-role", "kv_producer"],
         ["--role", "decode", "--kv-role", "kv_consumer", "--itl-ms", str(ITL_MS)]]
    )  # fmt: skip
    return [
        {"id": "p0", "url": p0.url, "role": "prefill", "max_concurrency": 1},
        {"id": "d0", "url": d0.url, "role": "decode", "max_concurrency": 1},
    ]


@pytest.fixture(params=["file", "etcd"])
def backend(request: pytest.FixtureRequest) -> str:
    param: str = request.param
    return param


@pytest.fixture(params=[1, 2], ids=["workers1", "workers2"])
def workers(request: pytest.FixtureRequest) -> int:
    param: int = request.param
    return param


@pytest.fixture
async def flow_pair(
    backend: str,
    workers: int,
    tmp_path: Path,
    sim_factory: SimFactory,
    request: pytest.FixtureRequest,
) -> AsyncIterator[Pair]:
    """router-a active with flow control on (`bounded`), router-b its warm standby."""
    sections = {
        "serving": {"policy": "bounded", "workers": workers, "request_timeout_s": 30},
        "flow": {"queue_limit": QUEUE_LIMIT},
    }
    engines = _engines(sim_factory)
    async with running_pair(backend, T, tmp_path, engines, request, sections) as pair:
        yield pair


async def _complete(
    session: aiohttp.ClientSession, router: RouterProcess, prompt: str, max_tokens: int = 4
) -> tuple[int, dict[str, str], Any, float]:
    """One completion: status, headers, body and when the answer came (monotonic)."""
    body = {"model": "demo-model", "prompt": prompt, "max_tokens": max_tokens}
    async with session.post(router.url + "/v1/completions", json=body) as resp:
        answer = await resp.json(content_type=None)
        return resp.status, dict(resp.headers), answer, time.monotonic()


async def test_a_takeover_while_the_queue_is_full_answers_every_held_request_503_at_once(
    flow_pair: Pair,
) -> None:
    http, a, b, t = flow_pair.http, flow_pair.a, flow_pair.b, flow_pair.t
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        started = time.monotonic()
        blocker = asyncio.create_task(_complete(session, a, "blocker", BLOCKER_TOKENS))

        async def flow_of(router: RouterProcess) -> Any:
            return await http.json(router, "/admin/flow", timeout_s=2.0)

        async def running() -> bool:
            # An answer before it was seen running (a 503 from a router that was not
            # admitting, on a loaded machine) is what to report, not a timeout.
            assert not blocker.done(), f"the blocker was answered: {blocker.result()[:3]}"
            doc = await flow_of(a)
            return bool(doc and doc["running"] == 1)

        await eventually(running, what="the blocker running on router-a")
        held = [asyncio.create_task(_complete(session, a, f"held{i}")) for i in range(3)]

        seen: list[Any] = []

        async def full() -> Any:
            doc = await flow_of(a)
            seen.append(doc)
            return doc if doc and doc["waiting"] == QUEUE_LIMIT else None

        try:
            before = await eventually(full, what="router-a's queue full")
        except AssertionError as exc:  # once, on a loaded run: say what was seen
            done = [t.done() for t in (blocker, *held)]
            raise AssertionError(f"{exc}; last documents {seen[-2:]}; answered {done}") from None
        assert before["refused"]["not_admitted"] == 0, before
        # The takeover: router-a frozen with its queue full, router-b takes the lease.
        flow_pair.freeze_outside_store_ops(a)
        frozen = time.monotonic()
        await _wait_ready(http, b, timeout_s=t.failover_bound_s + 5)
        # Its content is what counts: on a loaded machine a poll may time out (2 s), so ask
        # until one is answered.
        fresh = await eventually(lambda: flow_of(b), what="router-b's /admin/flow")
        assert fresh["enabled"] is True
        assert (fresh["waiting"], fresh["running"], fresh["priorities"]) == (0, 0, []), fresh
        assert set(fresh["refused"].values()) == {0}, fresh
        served = await _complete(session, b, "on the new active")
        assert served[0] == 200, served
        # Resumed past its TTL: it judges its lease lost on its own clock.
        await asyncio.sleep(max(0.0, frozen + t.ttl_s + 0.3 - time.monotonic()))
        assert not any(task.done() for task in held), "answered while frozen"
        thawed = time.monotonic()
        a.thaw()
        answers = await asyncio.gather(*held)
        last_answer = max(when for *_, when in answers)
        finished = await blocker
    for status, headers, body, _ in answers:
        assert status == 503, (status, body)
        assert headers["Retry-After"] == "1", headers
        assert body["error"]["message"] == "not admitting requests: fenced: lease lost", body
    took = last_answer - thawed
    print(f"FLOW TAKEOVER backend={flow_pair.backend} thaw->all answered={took:.3f}s")
    assert took < AT_ONCE_S, took
    # The request it was running is never cut: it ends as it would have, after the others.
    assert finished[0] == 200, finished
    assert finished[3] > last_answer
    assert finished[3] - started >= BLOCKER_TOKENS * ITL_MS / 1000 * 0.9
    after = await flow_of(a)
    assert after is not None, "router-a's /admin/flow unanswered"
    assert after["waiting"] == 0 and after["refused"]["not_admitted"] == QUEUE_LIMIT, after
    lease_a = await http.lease(a)
    assert lease_a is not None and lease_a["role"] != "active", lease_a
