"""llama.cpp: a prefill whose handoffs the decode cannot use builds a `kv_handoff` streak.

Against real `llama-server` processes. A decode server without `--swa-full` restores the slot
but recomputes the prompt; one that looks for slot files in another directory refuses the
restore. Either is a `kv_handoff` failure of the prefill, and the prefill's own success must
not clear it in between: with `recovery.eject_after: 2`, two requests hold the prefill for
inference verification (before, the streak went 0 -> 1 -> 0 and never got there).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from narwhal.engine.failures import FailureClass
from tests.support.llama import LlamaBinaries, LlamaServer, llama_binaries
from tests.support.poll import eventually
from tests.support.router import StartRouter

pytestmark = pytest.mark.llama

PROMPT = "Once upon a time in a land far away there lived a"
SECTIONS: dict[str, Any] = {
    "serving": {"request_timeout_s": 60, "first_token_timeout_s": 30, "stream_idle_timeout_s": 30},
    "engine": {"health_timeout_s": 2.0, "probe_timeout_s": 30.0},
    "controller": {"monitor_interval_s": 30.0},  # no probe clears the hold during the test
    "recovery": {"eject_after": 2, "liveness_misses": 100},
}


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A prefill server, a decode that recomputes (no `--swa-full`) and one that refuses (its
    slot directory is another one)."""
    bins: LlamaBinaries = llama_binaries()
    slot_dir = tmp_path_factory.mktemp("slots")
    started: dict[str, Any] = {"slot_dir": slot_dir}
    try:
        started["prefill"] = LlamaServer(bins, slot_dir).start()
        started["recomputes"] = LlamaServer(bins, slot_dir, swa_full=False).start()
        started["refuses"] = LlamaServer(bins, tmp_path_factory.mktemp("elsewhere")).start()
        yield started
    finally:
        for server in started.values():
            if isinstance(server, LlamaServer):
                server.stop()


def _engine(engine_id: str, server: LlamaServer, role: str, slot_dir: Path) -> dict[str, Any]:
    return {"id": engine_id, "url": server.url, "role": role, "api": "llamacpp",
            "slot_save_path": str(slot_dir)}  # fmt: skip


@pytest.mark.parametrize(("decode", "status"), [("recomputes", 200), ("refuses", 502)])
async def test_unusable_llama_handoffs_hold_the_prefill_at_eject_after(
    start_router: StartRouter,
    servers: dict[str, Any],
    http: aiohttp.ClientSession,
    decode: str,
    status: int,
) -> None:
    slot_dir = servers["slot_dir"]
    rr = await start_router(
        [_engine("p1", servers["prefill"], "prefill", slot_dir),
         _engine("d1", servers[decode], "decode", slot_dir)],
        **SECTIONS,
    )  # fmt: skip
    await eventually(lambda: rr.router.ready() is None, timeout_s=10, what="router ready")
    body = {"model": "demo-model", "temperature": 0, "prompt": PROMPT, "max_tokens": 4}
    for n in (1, 2):
        async with http.post(rr.url + "/v1/completions", json=body) as resp:
            assert resp.status == status, await resp.text()
        if n == 1:
            assert rr.router.fleet.get("p1").evidence == {FailureClass.KV_HANDOFF: 1}
    assert "inference_verification" in rr.holds("p1")
    assert rr.router.fleet.get("d1").evidence == {}
