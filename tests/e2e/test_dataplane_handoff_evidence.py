"""A handoff the decode refuses or silently recomputes is a `kv_handoff` streak of its prefill.

The prefill's own success ("prefill with an extracted handoff" clears kv_handoff evidence) is
recorded only once the decode is known to have used the handoff. Recorded first, it reset the
streak on every request (0 -> 1 -> 0) and an engine whose every handoff was unusable was never
held. The llama.cpp adapter is the one whose decode refuses (restore fails) or recomputes (its
timings say so); here a fake adapter on the vLLM protocol does either, against real sims, so
the test does not need llama-server. A decode that fails for another reason leaves the
prefill's success standing.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest

from narwhal.config import EngineConfig
from narwhal.engine.adapter import HandoffRefused
from narwhal.engine.failures import FailureClass
from narwhal.engine.transport import PoolKind
from narwhal.engine.vllm import VllmAdapter
from tests.support.poll import eventually
from tests.support.router import RunningRouter, StartRouter
from tests.support.sim_process import SimFactory

PREFILL = ["--role", "prefill", "--kv-role", "kv_producer"]
DECODE = ["--role", "decode", "--kv-role", "kv_consumer"]
# Swaps the adapter in this process's data plane.
pytestmark = pytest.mark.single_process

NO_SWEEPS = {"monitor_interval_s": 30.0}  # one pass at start, then no probe during the test


class RecomputingDecode(VllmAdapter):
    """Every decode answers, but evidently recomputed the prompt (as llama.cpp's timings tell)."""

    decode_verifies_handoff = True

    def recomputed(self, final_event: bytes | None) -> str | None:
        return "decode recomputed the prompt (fake adapter)"


class RefusingDecode(VllmAdapter):
    """Every decode refuses the handoff (as a llama.cpp slot restore that fails)."""

    decode_verifies_handoff = True

    @asynccontextmanager
    async def decode(
        self,
        pool: PoolKind,
        engine: EngineConfig,
        client_body: dict[str, Any],
        handoff: object,
        headers: Mapping[str, str],
        timeout_s: float,
    ) -> AsyncIterator[dict[str, Any]]:
        raise HandoffRefused("slot restore refused (fake adapter)")
        yield {}  # pragma: no cover


async def _router(
    sim_factory: SimFactory, start_router: StartRouter, adapter: type[VllmAdapter] | None
) -> tuple[RunningRouter, Any]:
    p0, d0 = sim_factory.start_many([PREFILL, DECODE])
    rr = await start_router(
        [{"id": "p0", "url": p0.url, "role": "prefill"},
         {"id": "d0", "url": d0.url, "role": "decode"}],
        controller=NO_SWEEPS, recovery={"eject_after": 2},
    )  # fmt: skip
    await eventually(lambda: rr.router.monitor.status.passes >= 1, what="the first pass")
    if adapter is not None:
        # The adapters are shared by the data plane: swap the one every engine here uses.
        router = rr.router
        router.adapters._by_api["vllm"] = adapter(router.client, 1.0)
    return rr, d0


async def _complete(http: aiohttp.ClientSession, rr: RunningRouter, stream: bool) -> int:
    body = {"model": "demo-model", "prompt": "handoff evidence", "max_tokens": 4, "stream": stream}
    async with http.post(rr.url + "/v1/completions", json=body) as resp:
        await resp.read()
        return resp.status


@pytest.mark.parametrize(
    ("adapter", "stream", "status"),
    [
        (RecomputingDecode, False, 200),
        (RecomputingDecode, True, 200),
        (RefusingDecode, False, 502),
        (RefusingDecode, True, 502),
    ],
    ids=["recomputed-json", "recomputed-stream", "refused-json", "refused-stream"],
)
async def test_unusable_handoffs_build_a_streak_that_holds_the_prefill(
    sim_factory: SimFactory,
    start_router: StartRouter,
    http: aiohttp.ClientSession,
    adapter: type[VllmAdapter],
    stream: bool,
    status: int,
) -> None:
    rr, _ = await _router(sim_factory, start_router, adapter)
    assert await _complete(http, rr, stream) == status
    assert rr.router.fleet.get("p0").evidence == {FailureClass.KV_HANDOFF: 1}
    assert await _complete(http, rr, stream) == status
    assert "inference_verification" in rr.holds("p0")
    assert rr.holds("d0") == []
    assert rr.router.fleet.get("d0").evidence == {}


async def test_a_decode_failing_for_another_reason_leaves_the_prefills_success_standing(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    rr, d0 = await _router(sim_factory, start_router, RefusingDecode)
    assert await _complete(http, rr, False) == 502
    assert rr.router.fleet.get("p0").evidence == {FailureClass.KV_HANDOFF: 1}

    rr.router.adapters._by_api["vllm"] = VllmAdapter(rr.router.client, 1.0)
    d0.add_fault({"kind": "completion_status", "status": 500, "leg": "decode", "count": 1})
    assert await _complete(http, rr, False) == 502
    assert rr.router.fleet.get("p0").evidence == {}  # the decode failed on its own account
    assert rr.router.fleet.get("d0").evidence == {FailureClass.INFERENCE_STATUS: 1}
