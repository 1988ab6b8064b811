"""The llamacpp adapter's wire contract: leg bodies, save replies, recompute detection, and
the generation it derives from health answers (docs/engines.md)."""

from __future__ import annotations

import asyncio
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import orjson
import pytest

from narwhal.clock import FakeClock
from narwhal.config import EngineConfig, Role
from narwhal.engine.adapter import HandoffRefused, SlotsBusy, Unreadable, finished_in_prefill
from narwhal.engine.llamacpp import (
    LlamaCppAdapter,
    SlotHandoff,
    SlotLayout,
    decode_body,
    layout_conflict,
    prefill_body,
    read_layout,
    recomputed,
    saved_tokens,
)
from narwhal.engine.transport import EngineClient, PoolKind, Reply
from tests.support.poll import eventually

CLIENT = {
    "model": "demo-model",
    "prompt": "hello",
    "max_tokens": 50,
    "stream": True,
    "stream_options": {"include_usage": True},
    "min_tokens": 3,
    "temperature": 0,
    # A client must not steer the router's slots or cache.
    "id_slot": 7,
    "cache_prompt": False,
    "n_predict": 900,
    "kv_transfer_params": {"remote_host": "evil"},
}


def test_prefill_body_runs_one_token_on_the_routers_slot() -> None:
    body = prefill_body(CLIENT, 1)
    assert body == {
        "model": "demo-model",
        "prompt": "hello",
        "max_tokens": 1,
        "stream": False,
        "temperature": 0,
        "id_slot": 1,
        "cache_prompt": True,
    }
    assert prefill_body({**CLIENT, "max_completion_tokens": 9}, 0)["max_completion_tokens"] == 1


def test_decode_body_is_the_clients_request_on_the_restored_slot() -> None:
    body = decode_body(CLIENT, 0)
    assert body["id_slot"] == 0 and body["cache_prompt"] is True
    assert body["max_tokens"] == 50 and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert "n_predict" not in body and "kv_transfer_params" not in body
    assert CLIENT["id_slot"] == 7  # the client's body is not modified


@pytest.mark.parametrize(
    ("status", "body", "expected"),
    [
        (200, b'{"id_slot":0,"filename":"f.bin","n_saved":27}', 27),
        (501, b'{"error":{"message":"This server does not support slots action."}}', None),
        (500, b"not json", None),
        (200, b"[]", None),
        (200, b'{"n_saved":0}', None),
        (200, b'{"n_saved":true}', None),
        (200, b'{"n_saved":"27"}', None),
    ],
)
def test_saved_tokens(status: int, body: bytes, expected: int | None) -> None:
    result = saved_tokens(status, body)
    if expected is None:
        assert isinstance(result, Unreadable)
    else:
        assert result == expected


def test_save_refusal_keeps_the_engines_message() -> None:
    result = saved_tokens(501, b'{"error":{"message":"slots action unsupported"}}')
    assert isinstance(result, Unreadable)
    assert "HTTP 501" in result.reason and "slots action unsupported" in result.reason


def _event(timings: object) -> bytes:
    return b"data: " + orjson.dumps({"choices": [], "timings": timings})


@pytest.mark.parametrize(
    ("final", "flagged"),
    [
        (_event({"cache_n": 26, "prompt_n": 1}), False),  # only the last prompt token
        (_event({"cache_n": 0, "prompt_n": 27}), True),  # the whole prompt again
        (_event({"cache_n": 20, "prompt_n": 7}), True),
        (orjson.dumps({"timings": {"cache_n": 0, "prompt_n": 27}}), True),  # a JSON body
        (_event(None), False),
        (b"data: not json", False),
        (None, False),
    ],
)
def test_recompute_detection(final: bytes | None, flagged: bool) -> None:
    reason = recomputed(final)
    assert (reason is not None) is flagged
    if flagged:
        assert reason is not None and "recomputed" in reason


def test_finished_in_prefill_only_on_stop() -> None:
    assert finished_in_prefill({"choices": [{"finish_reason": "stop"}]})
    assert not finished_in_prefill({"choices": [{"finish_reason": "length"}]})
    assert not finished_in_prefill({"choices": []})
    assert not finished_in_prefill(None)


class _StepBackClock(FakeClock):
    def step_wall_back(self, seconds: float) -> None:
        self._wall -= seconds  # NTP stepping the wall clock back


async def test_generation_starts_when_an_engine_answers_after_silence() -> None:
    clock = _StepBackClock(wall=1000.0)
    adapter = LlamaCppAdapter(EngineClient(1, 1), clock, 1.0)
    engine = EngineConfig(id="d0", url="http://127.0.0.1:1", role=Role.DECODE, api="llamacpp")

    async def generation() -> float | None:
        return (await adapter.generation(engine))[0]

    assert await generation() is None  # never seen answering
    adapter.observe_health("d0", True)
    assert await generation() == 1000.0
    clock.advance(5)
    adapter.observe_health("d0", True)  # still the same process
    assert await generation() == 1000.0
    adapter.observe_health("d0", False)  # silent: killed, or restarting
    clock.advance(5)
    adapter.observe_health("d0", True)
    assert await generation() == 1010.0
    # Never goes backwards, even when the wall clock does.
    adapter.observe_health("d0", False)
    clock.step_wall_back(500)
    adapter.observe_health("d0", True)
    later = await generation()
    assert later is not None and later > 1010.0


class _ScriptedEngine(EngineClient):
    """A fake transport: answers each POST by URL suffix, and records what was asked."""

    def __init__(self, replies: dict[str, Reply], on_save: Path | None = None) -> None:
        super().__init__(1, 1)
        self.replies = replies
        self.props: dict[str, object] = {}  # engine URL -> its /props answer
        self.on_save = on_save
        self.asked: list[tuple[str, dict[str, object]]] = []

    async def post(self, pool, url, body, headers, timeout_s, timeout_class=None):  # type: ignore[no-untyped-def, override]
        payload = orjson.loads(body)
        self.asked.append((url, payload))
        if url.endswith("action=save") and self.on_save is not None:
            (self.on_save / payload["filename"]).write_bytes(b"partial")  # a half-written file
        return next(r for suffix, r in self.replies.items() if url.endswith(suffix))

    async def get(self, pool, url, timeout_s, headers=None):  # type: ignore[no-untyped-def, override]
        return Reply(200, orjson.dumps(self.props[url.removesuffix("/props")]), "json")


def _llama(engine_id: str, role: Role, slot_dir: Path) -> EngineConfig:
    return EngineConfig(
        id=engine_id, url="http://127.0.0.1:1", role=role, api="llamacpp",
        slot_save_path=str(slot_dir),
    )  # fmt: skip


OK = Reply(200, orjson.dumps({"choices": [{"text": "x", "finish_reason": "length"}]}), "json")


async def test_a_failed_save_removes_the_partial_file_and_frees_the_slot(tmp_path: Path) -> None:
    fake = _ScriptedEngine(
        {"/v1/completions": OK, "action=save": Reply(500, b'{"error":"disk full"}', "json")},
        on_save=tmp_path,
    )
    adapter = LlamaCppAdapter(fake, FakeClock(), 1.0)
    p1 = _llama("p1", Role.PREFILL, tmp_path)
    headers = {"X-Request-Id": "r1"}
    reply = await adapter.prefill(PoolKind.DATA, p1, "completions", CLIENT, headers, 5.0)
    assert isinstance(reply.result, Unreadable) and "HTTP 500" in reply.result.reason
    assert os.listdir(tmp_path) == []
    assert adapter.slots("p1").busy == 0


@pytest.mark.parametrize(
    ("restore", "reason"),
    [
        (Reply(400, b'{"error":{"message":"failed to restore"}}', "json"), "failed to restore"),
        (Reply(200, b'{"n_restored": 3}', "json"), "read 3 tokens, the prefill saved 9"),
    ],
)
async def test_a_refused_restore_is_a_handoff_refusal_and_frees_the_slot(
    tmp_path: Path, restore: Reply, reason: str
) -> None:
    adapter = LlamaCppAdapter(_ScriptedEngine({"action=restore": restore}), FakeClock(), 1.0)
    d1 = _llama("d1", Role.DECODE, tmp_path)
    with pytest.raises(HandoffRefused, match=reason):
        async with adapter.decode(PoolKind.DATA, d1, CLIENT, SlotHandoff("f.bin", 9), {}, 5.0):
            pass
    assert adapter.slots("d1").busy == 0


async def test_a_restored_slot_is_held_for_the_decode_and_then_freed(tmp_path: Path) -> None:
    fake = _ScriptedEngine({"action=restore": Reply(200, b'{"n_restored": 9}', "json")})
    adapter = LlamaCppAdapter(fake, FakeClock(), 1.0)
    d1 = _llama("d1", Role.DECODE, tmp_path)
    async with adapter.decode(PoolKind.DATA, d1, CLIENT, SlotHandoff("f.bin", 9), {}, 5.0) as body:
        assert body["id_slot"] == 0 and body["cache_prompt"] is True
        assert adapter.slots("d1").busy == 1
        with pytest.raises(SlotsBusy):  # the one slot is taken until this decode ends
            async with adapter.decode(PoolKind.DATA, d1, CLIENT, SlotHandoff("g", 9), {}, 0.01):
                pass
    assert adapter.slots("d1").busy == 0
    assert fake.asked[0] == ("http://127.0.0.1:1/slots/0?action=restore", {"filename": "f.bin"})


def _props(slots: int, n_ctx: int) -> dict[str, object]:
    return {"total_slots": slots, "default_generation_settings": {"n_ctx": n_ctx}}


def test_read_layout() -> None:
    assert read_layout(_props(2, 2048)) == SlotLayout(2, 2048)
    assert read_layout({"total_slots": 3}) == SlotLayout(3, None)
    assert read_layout({"total_slots": 0}) is None
    assert read_layout({"total_slots": True}) is None
    assert read_layout([]) is None


def test_layouts_must_match_for_slot_files_to_restore() -> None:
    assert layout_conflict({}) is None
    assert layout_conflict({"p1": SlotLayout(2, 2048), "d1": SlotLayout(2, 2048)}) is None
    conflict = layout_conflict({"p1": SlotLayout(2, 2048), "d1": SlotLayout(1, 2048)})
    assert conflict is not None
    assert "d1 1 slots x 2048 ctx, p1 2 slots x 2048 ctx" in conflict


async def test_learn_sizes_the_slot_pool_and_warns_on_mismatched_layouts(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fake = _ScriptedEngine({})
    adapter = LlamaCppAdapter(fake, FakeClock(), 1.0)
    p1, d1 = _llama("p1", Role.PREFILL, tmp_path), _llama("d1", Role.DECODE, tmp_path)
    d1 = d1.model_copy(update={"url": "http://127.0.0.1:2"})
    fake.props = {p1.url: _props(4, 2048), d1.url: _props(1, 2048)}
    await adapter.learn(p1)
    assert adapter.slots("p1").size == 4
    assert not caplog.records
    await adapter.learn(d1)
    assert adapter.slots("d1").size == 1
    assert "differ in --parallel or --ctx-size" in caplog.text


async def test_a_cancelled_discard_still_removes_the_file(tmp_path: Path) -> None:
    """Requests are cancelled when their client goes away, often while discarding: the file
    must go even when the unlink job is still queued behind other work at that moment."""
    loop = asyncio.get_running_loop()
    loop.set_default_executor(ThreadPoolExecutor(max_workers=1))
    release = threading.Event()
    busy = loop.run_in_executor(None, release.wait)  # the only worker is taken
    (tmp_path / "r1-0.bin").write_bytes(b"kv")
    adapter = LlamaCppAdapter(_ScriptedEngine({}), FakeClock(), 1.0)
    p1 = _llama("p1", Role.PREFILL, tmp_path)
    discarding = asyncio.create_task(adapter.discard(p1, SlotHandoff("r1-0.bin", 9)))
    await asyncio.sleep(0)  # the unlink job is queued
    discarding.cancel()
    with pytest.raises(asyncio.CancelledError):
        await discarding
    release.set()
    await busy
    await eventually(lambda: not os.listdir(tmp_path), what="the slot file removed")
