"""The load client: closed-loop workers over one aiohttp session, request bodies as bytes.

Bodies are spliced from pre-encoded pieces (no JSON encoding per request). In `direct` mode the
client is the router: a prefill leg with `kv_transfer_params.do_remote_decode`, then the decode
leg with the handoff the prefill returned, spliced into the original body.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import math
import re
import statistics
import time
from dataclasses import dataclass, field, replace

import aiohttp

from bench.loadgen.spec import MARKER, RunResult, RunSpec
from bench.loadgen.workloads import Workload
from bench.stats import Histogram, summary

_PREFILL_PARAMS = (
    b',"kv_transfer_params":{"do_remote_decode":true,"do_remote_prefill":false,'
    b'"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}}'
)
_HEADERS = {"Content-Type": "application/json"}


class Bodies:
    """`{"model", "prompt": "<16 words> <i in 3 words> bnchld <12 words>", "max_tokens",
    "stream"}` (for 32 words) as bytes, and the headers of a request to the router (with
    `Authorization` when the spec has a key)."""

    def __init__(self, spec: RunSpec) -> None:
        self.headers = _HEADERS
        if spec.api_key:
            self.headers = {**_HEADERS, "Authorization": f"Bearer {spec.api_key}"}
        # `prompt_words` words: the first half the same in every request, then the request's
        # number in three words, the marker and the rest (32: 16 + 3 + 1 + 12). All are in
        # the bench tokenizer's vocabulary, so a prompt's token ids (and the block keys placed
        # by prefix) differ past the shared half, as a real prompt's would (a number outside
        # the vocabulary made every prompt's ids the same).
        words = [f"w{i % 256}" for i in range(max(0, spec.prompt_words - 4))]
        half = spec.prompt_words // 2  # 16 of 32: one block of 16 tokens shared
        shared, rest = " ".join(words[:half]), " ".join(words[half:])
        self.model_head = f'{{"model":{json.dumps(spec.model)},"prompt":'.encode()
        self.head = self.model_head + f'"{shared} '.encode()
        rest = f" {MARKER} {rest}".rstrip()
        self.tails = {
            True: f'{rest}","max_tokens":{spec.max_tokens},"stream":true}}'.encode(),
            False: f'{rest}","max_tokens":{spec.max_tokens},"stream":false}}'.encode(),
        }
        self.prefill_tail = f'{rest}","max_tokens":1,"stream":false'.encode() + _PREFILL_PARAMS

    def prompt(self, prompt: str, stream: bool) -> bytes:
        """A workload's prompt in the same body."""
        return self.model_head + json.dumps(prompt).encode() + self.tails[stream][1:]

    def body(self, i: int, stream: bool) -> bytes:
        return self.head + _number(i) + self.tails[stream]

    def prefill(self, i: int) -> bytes:
        return self.head + _number(i) + self.prefill_tail


def _number(i: int) -> bytes:
    """`i` (below 2**24) as three words of the bench tokenizer's vocabulary."""
    return b"w%d w%d w%d" % (i & 255, (i >> 8) & 255, (i >> 16) & 255)


_MESSAGE = re.compile(rb'"message"\s*:\s*"([^"]{0,80})')


def _error_reason(chunk: bytes) -> str:
    """`error_event: <the first words of its message>` (digits dropped, to keep few keys)."""
    match = _MESSAGE.search(chunk)
    text = match[1].decode(errors="replace") if match else ""
    text = ": ".join(text.split(": ")[:2])  # e.g. "upstream failure (stream): mid-stream ..."
    return "error_event: " + re.sub(r"\d+", "N", text).strip()


def _median_diff_ms(mine: list[float], base: list[float]) -> float:
    diffs = [(a - b) * 1000 for a, b in zip(mine, base, strict=True)]
    return statistics.median(diffs) if diffs else math.nan


class Failed(Exception):
    """`midstream`: the response's body had begun reaching the client when it failed, which
    is where Narwhal may no longer retry (DESIGN §1)."""

    def __init__(self, reason: str, midstream: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.midstream = midstream


@dataclass(slots=True)
class _Tally:
    latencies: list[float] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    gaps: Histogram = field(default_factory=Histogram)
    window: tuple[float, float] = (0.0, 0.0)
    window_chunks: int = 0
    in_flight: int = 0
    stall_ms: float = 1000.0


class Client:
    def __init__(self) -> None:
        self._session: aiohttp.ClientSession | None = None
        self._counter = itertools.count()
        self._rr = itertools.count()
        self._ready_url: str | None = None  # spec.failover: the router answering /ready 200

    async def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=60)
            self._session = aiohttp.ClientSession(
                connector=connector,
                timeout=aiohttp.ClientTimeout(total=None),
                skip_auto_headers=("User-Agent",),
                auto_decompress=False,
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def run(self, spec: RunSpec) -> RunResult:
        session = await self.session()
        bodies = Bodies(spec)
        if spec.warmup_requests:
            warm = RunSpec(**{**spec.to_json(), "records": False})
            await self._loop(warm, session, bodies, RunResult("warmup"), _Tally(), warmup=True)
        result = RunResult(spec.name)
        tally = _Tally(stall_ms=spec.stall_ms)
        cpu0 = time.process_time()
        follow = asyncio.create_task(self._follow(spec, session)) if spec.failover else None
        try:
            await self._loop(spec, session, bodies, result, tally, warmup=False)
        finally:
            if follow is not None:
                follow.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await follow
        result.client_cpu_s = time.process_time() - cpu0
        result.latency_ms = summary(x * 1000 for x in tally.latencies)
        result.ttft_ms = summary(x * 1000 for x in tally.ttfts)
        result.gap_ms = tally.gaps.summary()
        span = tally.window[1] - tally.window[0]
        result.steady_chunks_per_s = tally.window_chunks / span if span > 0 else 0.0
        return result

    async def _follow(self, spec: RunSpec, session: aiohttp.ClientSession) -> None:
        """Keep `_ready_url` on a router of `spec.failover` that answers /ready 200."""
        timeout = aiohttp.ClientTimeout(total=0.5)
        self._ready_url = spec.url
        while True:
            for base in spec.failover:
                try:
                    async with session.get(base + "/ready", timeout=timeout) as resp:
                        await resp.read()
                        if resp.status == 200:
                            self._ready_url = base + "/v1/completions"
                            break
                except (aiohttp.ClientError, OSError, TimeoutError):
                    continue
            await asyncio.sleep(0.1)

    async def paired(self, spec: RunSpec) -> RunResult:
        """Rounds of one request per target in `spec.paired`, in rotated order, one at a time."""
        session = await self.session()
        bodies = Bodies(spec)
        targets = list(spec.paired)
        tallies = [_Tally() for _ in targets]
        results = [RunResult(t) for t in targets]
        rows: list[list[float]] = []  # per complete round: latency per target
        result = RunResult(spec.name)
        result.t_start = time.monotonic()
        end = result.t_start + spec.duration_s
        n = 0
        while time.monotonic() < end and n < spec.max_requests:
            warm = n < spec.warmup_requests
            round_ = [math.nan] * len(targets)
            for k in range(len(targets)):
                j = (n + k) % len(targets)
                one = replace(spec, target="router" if targets[j] else "direct", url=targets[j])
                tally = _Tally() if warm else tallies[j]
                into = RunResult("warmup") if warm else results[j]
                ok = into.ok
                i = next(self._counter)
                await self._one(one, session, bodies, i, spec.stream == "yes", into, tally)
                if into.ok > ok and not warm:
                    round_[j] = tally.latencies[-1]
            if not warm and not any(math.isnan(x) for x in round_):
                rows.append(round_)
            n += 1
        result.t_end = time.monotonic()
        for j, target in enumerate(targets):
            base = [r[0] for r in rows]
            mine = [r[j] for r in rows]
            result.ok += results[j].ok
            for reason, count in results[j].failed.items():
                result.failed[reason] = result.failed.get(reason, 0) + count
            result.paired.append(
                {
                    "target": target,
                    "rounds": len(rows),
                    "latency_ms": summary(x * 1000 for x in mine),
                    "ttft_ms": summary(x * 1000 for x in tallies[j].ttfts),
                    "failed": results[j].failures,
                    "diff_p50_ms": _median_diff_ms(mine, base),
                }
            )
        return result

    async def _loop(
        self,
        spec: RunSpec,
        session: aiohttp.ClientSession,
        bodies: Bodies,
        result: RunResult,
        tally: _Tally,
        warmup: bool,
    ) -> None:
        limit = spec.warmup_requests if warmup else spec.max_requests
        start = time.monotonic()
        end = start + (spec.duration_s if not warmup else max(spec.duration_s, 30.0))
        tally.window = (start + spec.ramp_s, end)
        result.t_start = start

        sessions = Workload.from_json(spec.workload).sessions() if spec.workload else None

        async def worker(k: int) -> None:
            if spec.ramp_s and not warmup:
                await asyncio.sleep(k * spec.ramp_s / spec.concurrency)
            turns: list[str] = []
            while result.started < limit and time.monotonic() < end:
                result.started += 1
                i = next(self._counter)
                stream = spec.stream == "yes" or (spec.stream == "mixed" and i % 2 == 1)
                if sessions is None:
                    await self._one(spec, session, bodies, i, stream, result, tally)
                    continue
                if not turns:
                    turns = next(sessions)
                body = bodies.prompt(turns.pop(0), stream)
                await self._one(spec, session, bodies, i, stream, result, tally, body)

        await asyncio.gather(*(worker(k) for k in range(spec.concurrency)))
        result.t_end = time.monotonic()

    async def _one(
        self,
        spec: RunSpec,
        session: aiohttp.ClientSession,
        bodies: Bodies,
        i: int,
        stream: bool,
        result: RunResult,
        tally: _Tally,
        body: bytes | None = None,
    ) -> None:
        """One request: `body` (a workload's prompt) or the spec's `i`-th body."""
        t0 = time.monotonic()
        tally.in_flight += 1
        result.peak_in_flight = max(result.peak_in_flight, tally.in_flight)
        outcome = "ok"
        midstream = False
        try:
            async with asyncio.timeout(spec.deadline_s):
                if spec.target == "direct":
                    first = await self._direct(spec, session, bodies, i, stream, result, tally)
                else:
                    body = body or bodies.body(i, stream)
                    url = self._ready_url if spec.failover and self._ready_url else spec.url
                    first = await self._post(
                        session, url, body, i, stream, result, tally, bodies.headers
                    )
        except TimeoutError:
            outcome = "hung"
        except Failed as exc:
            outcome, midstream = exc.reason, exc.midstream
        except (aiohttp.ClientError, OSError) as exc:
            outcome = f"transport:{type(exc).__name__}"
        finally:
            tally.in_flight -= 1
        t1 = time.monotonic()
        if outcome == "ok":
            result.ok += 1
            tally.latencies.append(t1 - t0)
            if stream:
                tally.ttfts.append(first - t0)
                if (first - t0) * 1000 <= spec.ttft_slo_ms:
                    result.good += 1
        elif outcome == "hung":
            result.hung += 1
        else:
            result.failed[outcome] = result.failed.get(outcome, 0) + 1
        if spec.records:
            result.records.append(
                (round(t0, 4), round(t1, 4), outcome, int(stream), int(midstream))
            )

    async def _direct(
        self,
        spec: RunSpec,
        session: aiohttp.ClientSession,
        bodies: Bodies,
        i: int,
        stream: bool,
        result: RunResult,
        tally: _Tally,
    ) -> float:
        n = next(self._rr)
        prefill = spec.prefill[n % len(spec.prefill)] + "/v1/completions"
        decode = spec.decode[n % len(spec.decode)] + "/v1/completions"
        headers = {**_HEADERS, "X-Request-Id": f"bench-{i}"}
        async with session.post(prefill, data=bodies.prefill(i), headers=headers) as resp:
            data = await resp.read()
            if resp.status != 200:
                raise Failed(f"http_{resp.status}")
        params = json.loads(data).get("kv_transfer_params")
        if not isinstance(params, dict):
            raise Failed("bad_handoff")
        body = bodies.body(i, stream)
        body = body[:-1] + b',"kv_transfer_params":' + json.dumps(params).encode() + b"}"
        return await self._post(session, decode, body, i, stream, result, tally, headers)

    async def _post(
        self,
        session: aiohttp.ClientSession,
        url: str,
        body: bytes,
        i: int,
        stream: bool,
        result: RunResult,
        tally: _Tally,
        headers: dict[str, str] | None = None,
    ) -> float:
        """POST one completion; returns when its first byte of content arrived."""
        async with session.post(url, data=body, headers=headers or _HEADERS) as resp:
            if resp.status != 200:
                await resp.read()
                raise Failed(f"http_{resp.status}")
            if not stream:
                parts: list[bytes] = []
                try:
                    async for part in resp.content.iter_any():
                        parts.append(part)
                except (aiohttp.ClientError, OSError) as exc:
                    raise Failed(f"transport:{type(exc).__name__}", bool(parts)) from exc
                if b'"choices"' not in b"".join(parts):
                    raise Failed("bad_body", True)
                return time.monotonic()
            try:
                return await self._events(resp, result, tally)
            except (aiohttp.ClientError, OSError) as exc:
                raise Failed(
                    f"transport:{type(exc).__name__}", resp.content.total_bytes > 0
                ) from exc

    async def _events(
        self, resp: aiohttp.ClientResponse, result: RunResult, tally: _Tally
    ) -> float:
        """Read an SSE stream to `[DONE]`; returns when its first event arrived."""
        first = 0.0
        last = 0.0
        done = False
        tail = b""
        async for chunk in resp.content.iter_any():
            now = time.monotonic()
            events = chunk.count(b"data: ")
            if b'"error"' in chunk:
                raise Failed(_error_reason(chunk), True)
            seen = tail + chunk
            if b"[DONE]" in seen:
                done = True
                events -= 1
            tail = seen[-8:]
            if events <= 0:
                continue
            if first:
                gap_ms = (now - last) * 1000
                tally.gaps.add(gap_ms)
                if gap_ms > tally.stall_ms:
                    result.stalls += 1
            else:
                first = now
            last = now
            result.chunks += events
            if tally.window[0] <= now <= tally.window[1]:
                tally.window_chunks += events
        if not done:
            raise Failed("no_done", resp.content.total_bytes > 0)
        return first or time.monotonic()
