"""Migration (DESIGN §1): under `bounded`, a stream whose decode fails after part of the answer
reached the client goes on, from the same token, on a fresh prefill/decode pair.

Real processes: two prefill and two decode `narwhal-sim`s per test (a test may kill or freeze
one), streaming 24 tokens 20 ms apart. The sims' text is a function of everything before each
token, so a continuation from the wrong token, or a token lost or repeated, shows in the text.
Each test first runs the same request uninterrupted, then with the fault, through the official
`openai` client, and compares text, finish reason and usage exactly; every chunk must carry
one `id`, `created` and `model`.
"""

from __future__ import annotations

import re
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import openai
import orjson
import pytest

from tests.support.cli import narwhal
from tests.support.http import metric, metric_sum
from tests.support.poll import eventually
from tests.support.router import RunningRouter, StartRouter
from tests.support.sim_process import SimFactory, SimProcess

pytestmark = pytest.mark.slow

MODEL = "demo-model"
TOKENS = 24
MESSAGES = [{"role": "user", "content": "tell a long story about narwhals"}]

ENDPOINTS = ["completions", "chat"]


@dataclass
class Fleet:
    prefills: list[SimProcess]
    decodes: list[SimProcess]

    @property
    def all(self) -> list[SimProcess]:
        return [*self.prefills, *self.decodes]

    def engines(self) -> list[dict[str, Any]]:
        return [
            *(
                {"id": f"p{i}", "url": s.url, "role": "prefill"}
                for i, s in enumerate(self.prefills)
            ),
            *({"id": f"d{i}", "url": s.url, "role": "decode"} for i, s in enumerate(self.decodes)),
        ]

    def serving(self, prompt: str) -> SimProcess:
        """The decode sim that received this prompt's decode leg (since `forget`)."""
        for sim in self.decodes:
            if any(_prompt_of(r["body"]) == prompt for r in sim.requests()):
                return sim
        raise AssertionError(f"no decode received {prompt!r}")

    def forget(self) -> None:
        for sim in self.all:
            sim.clear_requests()


def _prompt_of(body: Any) -> str | None:
    if not isinstance(body, dict):
        return None
    if "messages" in body:
        return str(body["messages"][0]["content"])
    prompt = body.get("prompt")
    return prompt if isinstance(prompt, str) else None


def _fleet(*flags: str) -> Iterator[Fleet]:
    factory = SimFactory()
    p = ["--role", "prefill", "--kv-role", "kv_producer", *flags]
    d = ["--role", "decode", "--kv-role", "kv_consumer", "--itl-ms", "20", *flags]
    try:
        sims = factory.start_many([p, p, d, d])
        yield Fleet(sims[:2], sims[2:])
    finally:
        factory.close()


@pytest.fixture
def fleet() -> Iterator[Fleet]:
    yield from _fleet()


@pytest.fixture
def fleet_without_ids() -> Iterator[Fleet]:
    yield from _fleet("--no-token-ids")


async def _router(start_router: StartRouter, fleet: Fleet, **serving: Any) -> RunningRouter:
    rr = await start_router(
        fleet.engines(),
        serving={"policy": "bounded", **serving},
        recovery={"eject_after": 1, "liveness_misses": 100},
    )
    await rr.ready()
    return rr


@dataclass
class Run:
    text: str = ""
    chunks: int = 0
    heads: set[tuple[str, int, str]] = field(default_factory=set)
    finish_reason: str | None = None
    usage: tuple[int, int, int] | None = None


OnChunk = Callable[[int], Awaitable[None]]


async def _nothing(_: int) -> None:
    return None


async def _stream(
    url: str,
    endpoint: str,
    prompt: str,
    on_chunk: OnChunk = _nothing,
    extra_body: dict[str, Any] | None = None,
) -> Run:
    """One streamed request through the openai client; `on_chunk(n)` after the n-th chunk
    that carried text."""
    run = Run()
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="k", max_retries=0) as client:
        args: dict[str, Any] = {
            "model": MODEL,
            "max_tokens": TOKENS,
            "stream": True,
            "stream_options": {"include_usage": True},
            "seed": 7,
            "extra_body": extra_body,
        }
        if endpoint == "chat":
            messages = [{"role": "user", "content": prompt}]
            stream = await client.chat.completions.create(messages=messages, **args)
        else:
            stream = await client.completions.create(prompt=prompt, **args)
        async for chunk in stream:
            run.heads.add((chunk.id, chunk.created, chunk.model))
            if chunk.usage is not None:
                u = chunk.usage
                run.usage = (u.prompt_tokens, u.completion_tokens, u.total_tokens)
            for choice in chunk.choices:
                text = choice.delta.content if endpoint == "chat" else choice.text
                run.finish_reason = choice.finish_reason or run.finish_reason
                if text:
                    run.text += text
                    run.chunks += 1
                    await on_chunk(run.chunks)
    return run


def _assert_same(run: Run, reference: Run) -> None:
    assert run.text == reference.text
    assert run.finish_reason == reference.finish_reason == "length"
    assert run.usage == reference.usage and run.usage is not None
    assert run.usage[1] == TOKENS
    assert len(run.heads) == 1, run.heads  # one id, created and model for every chunk


async def _migrations(rr: RunningRouter, **labels: str) -> float:
    async with aiohttp.ClientSession() as http:
        return await metric(http, rr.url, "narwhal_migrations_total", **labels)


async def _timeline(
    rr: RunningRouter, http: aiohttp.ClientSession, count: int = 1
) -> list[dict[str, Any]]:
    """The migration events of the router's timeline (`GET /admin/events`), once there are
    `count` (a worker reports them to the control process as they happen)."""

    async def migrations() -> list[dict[str, Any]] | None:
        async with http.get(rr.url + "/admin/events") as r:
            events = [e for e in (await r.json())["events"] if e["kind"] == "migration"]
        return events if len(events) >= count else None

    return await eventually(migrations, timeout_s=5, what=f"{count} migration events")


async def _saved(rr: RunningRouter, result: str = "saved") -> float:
    """Streams migrated and saved (or lost), once the count is 1: the router counts a stream
    when its outcome settles, which may be just after the client read its end."""
    async with aiohttp.ClientSession() as http:

        async def counted() -> float | None:
            n = await metric(http, rr.url, "narwhal_migrated_streams_total", result=result)
            return n if n >= 1 else None

        return await eventually(counted, timeout_s=2, what=f"a migrated stream {result}")


# ------------------------------------------------------------------ the four failures


async def _killed_after_5(rr: RunningRouter, fleet: Fleet, endpoint: str) -> tuple[Run, Run]:
    """The request uninterrupted, then again with its decode killed (SIGKILL) after the
    client had 5 chunks."""
    prompt = f"killed {endpoint} stream"
    reference = await _stream(rr.url, endpoint, prompt)
    fleet.forget()

    async def kill(n: int) -> None:
        if n == 5:
            fleet.serving(prompt).kill()

    return reference, await _stream(rr.url, endpoint, prompt, kill)


@pytest.mark.parametrize("endpoint", ENDPOINTS)
async def test_a_decode_killed_mid_stream_is_continued_exactly(
    endpoint: str, fleet: Fleet, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    rr = await _router(start_router, fleet)
    reference, run = await _killed_after_5(rr, fleet, endpoint)
    _assert_same(run, reference)
    assert await _migrations(rr, cause="connection_lost", kind="token_ids") == 1
    assert await _saved(rr) == 1
    # On the timeline, from whichever process served it: the engine it left, and why.
    [event] = await _timeline(rr, http)
    killed = next(i for i, d in enumerate(fleet.decodes) if not d.running)
    assert event["engine"] == f"d{killed}"
    # The kill is sent once the client has 5 chunks; the engine may have produced more
    # before it died (a loaded host once let a 6th through): never fewer.
    moved = re.search(
        r"after (\d+) tokens \(connection_lost, token_ids, migration 1\)", event["what"]
    )
    assert moved is not None and int(moved[1]) >= 5, event["what"]


@pytest.mark.parametrize("endpoint", ENDPOINTS)
async def test_a_decode_frozen_past_the_idle_deadline_is_continued_exactly(
    endpoint: str, fleet: Fleet, start_router: StartRouter
) -> None:
    rr = await _router(start_router, fleet)
    prompt = f"frozen {endpoint} stream"
    reference = await _stream(rr.url, endpoint, prompt)
    fleet.forget()
    frozen: list[SimProcess] = []

    async def freeze(n: int) -> None:
        if n == 5:
            frozen.append(fleet.serving(prompt))
            frozen[0].freeze()

    try:
        started = time.monotonic()
        run = await _stream(rr.url, endpoint, prompt, freeze)
        elapsed = time.monotonic() - started
    finally:
        for sim in frozen:
            sim.thaw()
    _assert_same(run, reference)
    assert elapsed > 1.0  # the idle deadline (1 s) passed before the stream went on
    assert await _migrations(rr, cause="stream_idle", kind="token_ids") == 1


@pytest.mark.parametrize("endpoint", ENDPOINTS)
@pytest.mark.parametrize(
    ("fault", "cause"),
    [("malformed_event", "invalid_termination"), ("error_event", "error_event")],
)
async def test_a_stream_that_breaks_in_band_is_continued_exactly(
    endpoint: str, fault: str, cause: str, fleet: Fleet, start_router: StartRouter
) -> None:
    """After 5 tokens the decode sends a malformed event, or vLLM's in-band error event and
    `[DONE]`: neither reaches the client, and the stream goes on. (The fault is set on both
    decodes; once the first token shows which one serves, the other's is taken away.)"""
    rr = await _router(start_router, fleet)
    prompt = f"{fault} {endpoint} stream"
    reference = await _stream(rr.url, endpoint, prompt)
    fleet.forget()
    for sim in fleet.decodes:
        sim.add_fault({"kind": fault, "leg": "decode", "count": 1, "after_tokens": 5})

    async def spare_the_other(n: int) -> None:
        if n == 1:
            serving = fleet.serving(prompt)
            for sim in fleet.decodes:
                if sim is not serving:
                    sim.clear_faults()

    run = await _stream(rr.url, endpoint, prompt, spare_the_other)
    _assert_same(run, reference)
    assert await _migrations(rr, cause=cause, kind="token_ids") == 1


@pytest.mark.parametrize("endpoint", ENDPOINTS)
async def test_without_token_ids_a_stream_is_continued_from_its_text(
    endpoint: str, fleet_without_ids: Fleet, start_router: StartRouter
) -> None:
    """Engines that return no token ids: the completion's prompt plus the delivered text,
    or the chat with the delivered text as a final assistant message to continue."""
    rr = await _router(start_router, fleet_without_ids)
    reference, run = await _killed_after_5(rr, fleet_without_ids, endpoint)
    assert run.text == reference.text
    assert len(run.heads) == 1
    assert await _migrations(rr, cause="connection_lost", kind="text") == 1


# ------------------------------------------------------------------ limits and the client


async def _raw_stream(url: str, body: dict[str, Any], http: aiohttp.ClientSession) -> list[Any]:
    """The stream's data payloads (JSON objects, or "[DONE]")."""
    async with http.post(url + "/v1/completions", json=body) as resp:
        assert resp.status == 200
        raw = await resp.read()
    events = [e.removeprefix(b"data: ") for e in raw.split(b"\n\n") if e]
    return [e.decode() if e == b"[DONE]" else orjson.loads(e) for e in events]


BODY = {"model": MODEL, "prompt": "a limited stream", "max_tokens": TOKENS, "stream": True}


async def test_past_the_migration_limit_the_stream_ends_with_the_error_event(
    fleet: Fleet, start_router: StartRouter
) -> None:
    rr = await _router(start_router, fleet, migration_limit=1)
    for sim in fleet.decodes:
        sim.add_fault({"kind": "error_event", "leg": "decode"})
    async with aiohttp.ClientSession() as http:
        events = await _raw_stream(rr.url, BODY, http)
    texts = [e["choices"][0]["text"] for e in events[:-1]]
    assert len(texts) == 2, events  # the first token of the first leg and of the continuation
    assert "[DONE]" not in events  # an error event ends the stream (DESIGN §1)
    assert "upstream failure (inference_status)" in events[-1]["error"]["message"]
    assert await _migrations(rr, cause="error_event", kind="token_ids") == 1
    assert await _saved(rr, "lost") == 1
    async with aiohttp.ClientSession() as http:
        continued, lost = await _timeline(rr, http, count=2)
    assert "(error_event, token_ids, migration 1)" in continued["what"]
    assert lost["what"].endswith("after 2 tokens and 1 migrations (error_event)")
    assert lost["engine"] != continued["engine"]  # the continuation broke on the other decode


async def test_a_deadline_exhausted_while_migrating_ends_with_the_error_event(
    fleet: Fleet, start_router: StartRouter
) -> None:
    """The continuation's prefills stall past the request's deadline (3 s)."""
    rr = await _router(start_router, fleet, request_timeout_s=3)
    for sim in fleet.decodes:
        sim.add_fault({"kind": "error_event", "leg": "decode", "count": 1})
    http = aiohttp.ClientSession()
    started = time.monotonic()
    async with http, http.post(rr.url + "/v1/completions", json=BODY) as resp:
        first = await resp.content.readuntil(b"\n\n")
        assert b'"text"' in first
        for sim in fleet.prefills:
            sim.add_fault({"kind": "stall_first_token", "leg": "prefill", "delay_s": 10})
        rest = await resp.read()
    elapsed = time.monotonic() - started
    assert b"[DONE]" not in rest
    last = orjson.loads(rest.strip().split(b"\n\n")[-1].removeprefix(b"data: "))
    assert "upstream" in last["error"]["message"], last
    assert elapsed < 3 + 1.0
    assert await _saved(rr, "lost") == 1


async def test_a_client_that_leaves_during_a_migration_stops_it_and_charges_nothing(
    fleet: Fleet, start_router: StartRouter
) -> None:
    rr = await _router(start_router, fleet)
    for sim in fleet.decodes:
        sim.add_fault({"kind": "error_event", "leg": "decode", "count": 1})
    http = aiohttp.ClientSession()
    async with http:
        resp = await http.post(rr.url + "/v1/completions", json=BODY)
        await resp.content.readuntil(b"\n\n")  # the first token
        for sim in fleet.prefills:
            sim.add_fault({"kind": "stall_first_token", "leg": "prefill", "delay_s": 10})
            sim.clear_requests()

        def continuing() -> bool:  # the continuation's prefill has begun
            return any(sim.requests() for sim in fleet.prefills)

        await eventually(continuing, what="the continuation's prefill")
        resp.close()

        async def settled() -> bool:
            engines = await (await http.get(rr.url + "/admin/engines")).json()
            return all(e["in_flight"] == 0 for e in engines["engines"])

        await eventually(settled, what="nothing in flight")
        async with http.get(rr.url + "/metrics") as r:
            text = await r.text()
    failures = "narwhal_engine_failures_total"
    assert metric_sum(text, failures, engine="p0") + metric_sum(text, failures, engine="p1") == 0
    assert metric_sum(text, failures, failure_class="inference_status") == 1  # the decode's
    assert metric_sum(text, "narwhal_migrated_streams_total") == 0


async def test_single_attempt_never_migrates(fleet: Fleet, start_router: StartRouter) -> None:
    """Today's behaviour: the engine's error event reaches the client as it was sent."""
    rr = await start_router(fleet.engines(), serving={"policy": "single_attempt"})
    for sim in fleet.decodes:
        sim.add_fault({"kind": "error_event", "leg": "decode", "count": 1})
    async with aiohttp.ClientSession() as http:
        events = await _raw_stream(rr.url, BODY, http)
    assert events[-1] == "[DONE]"
    assert "narwhal-sim: injected error_event" in events[-2]["error"]["message"]
    assert await _migrations(rr) == 0


async def test_a_finished_generation_whose_end_was_lost_is_ended_without_migrating(
    fleet: Fleet, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    """Every token and the finish reason arrived, then the decode ended without `[DONE]`:
    nothing is left to generate, so the client gets its usage and `[DONE]` at once."""
    rr = await _router(start_router, fleet)
    body = {**BODY, "stream_options": {"include_usage": True}}
    reference = await _raw_stream(rr.url, body, http)
    for sim in fleet.decodes:
        sim.add_fault({"kind": "no_done", "leg": "decode", "count": 1})
    events = await _raw_stream(rr.url, body, http)
    assert events[-1] == "[DONE]"
    counts = ("prompt_tokens", "total_tokens", "completion_tokens")
    assert [events[-2]["usage"][k] for k in counts] == [reference[-2]["usage"][k] for k in counts]
    text = "".join(e["choices"][0]["text"] for e in events if isinstance(e, dict) and e["choices"])
    ref = "".join(
        e["choices"][0]["text"] for e in reference if isinstance(e, dict) and e["choices"]
    )
    assert text == ref
    assert await _migrations(rr) == 0
    assert await _saved(rr) == 1


# ------------------------------------------------------------------ planned maintenance


@pytest.mark.parametrize("endpoint", ENDPOINTS)
async def test_maintenance_with_migrate_moves_a_stream_off_its_decode_at_once(
    endpoint: str, fleet: Fleet, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    """`narwhal maintenance ID --migrate` after the client had 5 chunks: the stream goes on
    on the other decode, exactly, with nothing charged to the engine it left, which holds
    `planned_maintenance` and stays up (nothing was killed)."""
    rr = await _router(start_router, fleet)
    prompt = f"maintenance {endpoint} stream"
    reference = await _stream(rr.url, endpoint, prompt)
    fleet.forget()
    # Tokens 10x slower from here: the CLI (a Python process, 0.3-0.5 s to start on a loaded
    # machine) must act while the stream still runs (19 tokens left: about 4 s).
    for sim in fleet.decodes:
        sim.add_fault({"kind": "slow", "factor": 10, "leg": "decode"})
    moved: list[str] = []

    async def maintenance(n: int) -> None:
        if n == 5:
            engine = f"d{fleet.decodes.index(fleet.serving(prompt))}"
            cli = await narwhal("--url", rr.url, "maintenance", engine, "--migrate")
            assert cli.code == 0, cli.err
            moving = f"{engine}: planned_maintenance, its streams moving to other engines"
            assert cli.out.strip() == moving
            moved.append(engine)

    run = await _stream(rr.url, endpoint, prompt, maintenance)
    _assert_same(run, reference)
    assert await _migrations(rr, cause="maintenance", kind="token_ids") == 1
    assert await _saved(rr) == 1
    left = fleet.decodes[int(moved[0][1:])]
    other = fleet.decodes[1 - int(moved[0][1:])]
    assert [r for r in other.requests() if isinstance(r["body"].get("prompt"), list)]
    assert left.running
    async with http.get(rr.url + "/metrics") as r:
        text = await r.text()
    assert metric_sum(text, "narwhal_engine_failures_total", engine=moved[0]) == 0
    engines = await (await http.get(rr.url + "/admin/engines")).json()
    state = next(e for e in engines["engines"] if e["id"] == moved[0])
    assert state["holds"] == ["planned_maintenance"]
    assert state["ejected"] is False and not any(state["evidence"].values())
    [event] = await _timeline(rr, http)
    assert event["engine"] == moved[0] and "(maintenance, token_ids, migration 1)" in event["what"]


async def test_maintenance_with_migrate_is_refused_where_streams_never_migrate(
    fleet: Fleet, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    """Under `single_attempt` nothing can move: 409, and no hold is taken. A `migrate` that is
    not a boolean is a 400 that names it."""
    rr = await start_router(fleet.engines(), serving={"policy": "single_attempt"})
    url = rr.url + "/admin/engines/d0/maintenance"
    async with http.post(url, json={"migrate": True}) as resp:
        assert resp.status == 409
        assert "serving.policy bounded" in (await resp.json())["error"]["message"]
    async with http.post(url, json={"migrate": "yes"}) as resp:
        assert resp.status == 400
        assert (await resp.json())["error"]["param"] == "migrate"
    engines = await (await http.get(rr.url + "/admin/engines")).json()
    assert all(e["holds"] == [] for e in engines["engines"])
