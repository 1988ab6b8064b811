"""Open-loop load for the `flow` suite: requests arrive on a seeded Poisson schedule per class
(client key, priority), whatever the router answers, and are never retried.

Each request is a streamed completion carrying its class's `priority` in the body and its
key as `Authorization: Bearer <key>`. A 429 is counted, with the time it took and the reason
its message gives, and not retried: what a flow-controlled router refuses must show as refused.
Every request is one record; the suite's report computes everything from the records.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp

from bench.loadgen.spec import MARKER

# status of a record that got no HTTP answer
TRANSPORT = 0  # connection refused, reset or closed before the answer
HUNG = -1  # no answer by the client's deadline


@dataclass(frozen=True, slots=True)
class FlowClass:
    key: int  # index into FlowSpec.keys
    priority: int
    rate_per_s: float


@dataclass(frozen=True, slots=True)
class FlowSpec:
    name: str
    url: str
    model: str
    keys: tuple[str, ...]  # client keys ("" sends no Authorization)
    classes: tuple[FlowClass, ...]
    duration_s: float  # arrivals stop after this; the answers are awaited (deadline_s)
    deadline_s: float
    max_tokens: int = 16
    # Each request asks max_tokens ± this (uniform, seeded per request: the same for every
    # arm). Answers of one fixed length keep the engines' slots in lockstep (a burst of
    # starts ends as a burst, forever), which no real workload does.
    max_tokens_spread: int = 0
    prompt_words: int = 32
    seed: int = 31
    send_priority: bool = True

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> FlowSpec:
        doc = dict(doc)
        doc["keys"] = tuple(doc["keys"])
        doc["classes"] = tuple(FlowClass(**c) for c in doc["classes"])
        return cls(**doc)


@dataclass(slots=True)
class FlowRecord:
    """One request. Times in seconds from the run's start; `ttft_s` and `tokens` only when
    streamed content came; `reason` for a refusal or failure (a 429's kind from its message)."""

    sent_s: float
    key: int
    priority: int
    status: int  # HTTP status, TRANSPORT or HUNG
    latency_s: float  # to the answer's end (a refusal: to its status)
    ttft_s: float | None = None
    tokens: int = 0
    reason: str = ""

    def row(self) -> list[Any]:
        return [
            round(self.sent_s, 4),
            self.key,
            self.priority,
            self.status,
            round(self.latency_s, 5),
            None if self.ttft_s is None else round(self.ttft_s, 5),
            self.tokens,
            self.reason,
        ]


@dataclass(slots=True)
class FlowResult:
    name: str
    records: list[list[Any]] = field(default_factory=list)  # FlowRecord.row() each
    elapsed_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> FlowResult:
        return cls(**doc)


def schedule(spec: FlowSpec) -> list[tuple[float, FlowClass]]:
    """Every arrival of the run, in time order: a Poisson process per class, seeded by the
    spec's seed and the class, so every arm of a run is sent the same requests."""
    out: list[tuple[float, FlowClass]] = []
    for c in spec.classes:
        if c.rate_per_s <= 0:
            continue
        rng = random.Random(f"{spec.seed}:{c.key}:{c.priority}")
        t = rng.expovariate(c.rate_per_s)
        while t < spec.duration_s:
            out.append((t, c))
            t += rng.expovariate(c.rate_per_s)
    out.sort(key=lambda a: a[0])
    return out


def refusal_reason(body: bytes) -> str:
    """A 429's kind from Narwhal's message: `queue_full`, `deadline`, `rate_limit`, else
    `other` (a peer's own words)."""
    try:
        message = str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return "other"
    if "queue is full" in message:
        return "queue_full"
    if "wait limit" in message:
        return "deadline"
    if "Rate limit" in message or "Request too large" in message:
        return "rate_limit"
    return "other"


class _Body:
    def __init__(self, spec: FlowSpec) -> None:
        words = " ".join(f"w{i % 256}" for i in range(max(0, spec.prompt_words - 2)))
        self.spec = spec
        self.words = f"{words} {MARKER} n"

    def make(self, i: int, priority: int) -> bytes:
        spec = self.spec
        max_tokens = spec.max_tokens
        if spec.max_tokens_spread:
            spread = spec.max_tokens_spread
            max_tokens += random.Random(f"{spec.seed}:{i}").randint(-spread, spread)
        doc: dict[str, Any] = {
            "model": spec.model,
            "prompt": f"{self.words}{i}",
            "max_tokens": max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.spec.send_priority:
            doc["priority"] = priority
        return json.dumps(doc).encode()


async def _read_stream(resp: aiohttp.ClientResponse, t0: float) -> tuple[float | None, int, str]:
    """(TTFT, tokens, failure reason or "") of an SSE stream read to `[DONE]`."""
    ttft: float | None = None
    events = 0
    usage: int | None = None
    buffer = b""
    done = False
    async for chunk in resp.content.iter_any():
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            if not line.startswith(b"data: "):
                continue
            data = line[6:].strip()
            if data == b"[DONE]":
                done = True
                continue
            doc = json.loads(data)
            if "error" in doc:
                return ttft, events, "error_event"
            if doc.get("choices"):
                events += 1
                if ttft is None:
                    ttft = time.monotonic() - t0
            if doc.get("usage"):
                usage = int(doc["usage"].get("completion_tokens") or 0)
    if not done:
        return ttft, events, "no_done"
    return ttft, usage if usage is not None else events, ""


async def _one(
    session: aiohttp.ClientSession, spec: FlowSpec, body: bytes, c: FlowClass, start: float
) -> FlowRecord:
    t0 = time.monotonic()
    record = FlowRecord(t0 - start, c.key, c.priority, HUNG, spec.deadline_s)
    headers = {"Content-Type": "application/json"}
    if spec.keys[c.key]:
        headers["Authorization"] = f"Bearer {spec.keys[c.key]}"
    try:
        async with asyncio.timeout(spec.deadline_s):
            async with session.post(spec.url, data=body, headers=headers) as resp:
                record.status = resp.status
                if resp.status != 200:
                    text = await resp.read()
                    record.latency_s = time.monotonic() - t0
                    if resp.status == 429:
                        record.reason = refusal_reason(text)
                    return record
                ttft, tokens, reason = await _read_stream(resp, t0)
                record.ttft_s, record.tokens, record.reason = ttft, tokens, reason
    except TimeoutError:
        record.status, record.reason = HUNG, "hung"
        return record
    except (aiohttp.ClientError, OSError) as exc:
        record.status, record.reason = TRANSPORT, f"transport:{type(exc).__name__}"
    record.latency_s = time.monotonic() - t0
    return record


async def run_flow(session: aiohttp.ClientSession, spec: FlowSpec) -> FlowResult:
    """Send the schedule open-loop; wait for every answer (each bounded by `deadline_s`)."""
    body = _Body(spec)
    arrivals = schedule(spec)
    start = time.monotonic()
    tasks: list[asyncio.Task[FlowRecord]] = []
    for i, (at, c) in enumerate(arrivals):
        delay = start + at - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(_one(session, spec, body.make(i, c.priority), c, start)))
    records = await asyncio.gather(*tasks)
    return FlowResult(spec.name, [r.row() for r in records], time.monotonic() - start)
