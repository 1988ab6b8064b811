"""Writing a completion as SSE, with the stream faults (stall, no [DONE], malformed event).

Events are buffered and flushed only before a wait, so a stream with no inter-token latency
costs one write.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

from aiohttp import web

from narwhal.sim.engine import Outcome
from narwhal.sim.latency import Sleeper, pause
from narwhal.sim.shapes import (
    DONE,
    ERROR_EVENT,
    MALFORMED_EVENT,
    ChunkTemplate,
    Envelope,
    usage,
)

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


@dataclass(frozen=True, slots=True)
class StreamFaults:
    stall_after_tokens: int | None = None  # go silent once this many tokens were sent
    stall_s: float | None = None  # for this long (None: forever)
    no_done: bool = False
    malformed_after: int | None = None  # a non-JSON event once this many tokens were sent
    # vLLM's in-band error event, then [DONE], once this many tokens were sent
    error_after: int | None = None


def events(
    env: Envelope, outcome: Outcome, include_usage: bool, faults: StreamFaults
) -> Iterator[tuple[bytes, bool]]:
    """The stream's events in order, each flagged True when it carries a generated token."""
    tpl = ChunkTemplate(env)
    gen = outcome.generated
    if env.chat:
        yield tpl.role(), False
    last = len(gen.indices) - 1
    for i, word in enumerate(gen.indices):
        if i == last and gen.finish_reason == "length":
            yield tpl.final(word, "length", None), True
        else:
            yield tpl.token(word), True
        if i + 1 == faults.malformed_after:
            yield MALFORMED_EVENT, False
        if i + 1 == faults.error_after:
            yield ERROR_EVENT, False
            yield DONE, False
            return
    if gen.finish_reason != "length":
        if faults.malformed_after is not None and last < 0:
            yield MALFORMED_EVENT, False
        yield tpl.final(None, gen.finish_reason, gen.stop_reason), False
    if include_usage:
        yield tpl.usage(usage(outcome.prompt_tokens, last + 1, outcome.cached_tokens)), False
    if not faults.no_done:
        yield DONE, False


async def write_stream(
    request: web.Request,
    env: Envelope,
    outcome: Outcome,
    include_usage: bool,
    faults: StreamFaults,
    sleeper: Sleeper,
) -> web.StreamResponse:
    """Send the events, waiting the inter-token latency between tokens; a gone client ends it."""
    resp = web.StreamResponse(headers=SSE_HEADERS)
    await resp.prepare(request)
    buffer: list[bytes] = []
    tokens_sent = 0
    stall_pending = faults.stall_after_tokens is not None
    with contextlib.suppress(ConnectionResetError):
        for event, is_token in events(env, outcome, include_usage, faults):
            wait_itl = is_token and tokens_sent > 0 and outcome.itl_s > 0
            stall_now = stall_pending and tokens_sent >= (faults.stall_after_tokens or 0)
            if (wait_itl or stall_now) and buffer:
                await resp.write(b"".join(buffer))
                buffer.clear()
            if stall_now:
                stall_pending = False
                await pause(sleeper, faults.stall_s)
            if wait_itl:
                await sleeper(outcome.itl_s)
            buffer.append(event)
            tokens_sent += is_token
        await resp.write(b"".join(buffer))
        await resp.write_eof()
    return resp
