"""Starting from the saved handoff: `--resume` applies it when it matches the configured
fleet (DESIGN §4), and every start continues its sequence so that it never goes back."""

from __future__ import annotations

import asyncio
import logging

import orjson

from narwhal.clock import Clock
from narwhal.config import Config
from narwhal.fleet.store import Fleet
from narwhal.state.handoff import (
    MAX_SEQUENCE,
    HandoffWriter,
    UnreadableHandoff,
    Verdict,
    apply_document,
    check_document,
    load_schema,
    read_handoff,
    refused,
)
from narwhal.telemetry.metrics import Metrics

log = logging.getLogger("narwhal.resume")


async def resume(
    config: Config, handoff: HandoffWriter, fleet: Fleet, clock: Clock, metrics: Metrics
) -> Verdict:
    """`--resume`: apply the saved handoff only if schema and engine set match; the verdict
    says what was done and why."""
    try:
        raw = await asyncio.to_thread(read_handoff, handoff.path)
    except UnreadableHandoff as exc:
        verdict = refused("unreadable", str(exc))
    else:
        verdict = check_document(raw, config, load_schema(), now_wall_s=clock.wall())
    if verdict.ok and verdict.document is not None:
        apply_document(verdict.document, fleet, clock)
        handoff.continue_from(verdict.document)
        log.info("resume: %s", verdict.reason)
    else:
        log.warning("resume: starting fresh: %s", verdict.reason)
    metrics.handoff_resume.labels("applied" if verdict.ok else "refused").inc()
    if not verdict.ok:
        metrics.handoff_resume_refusals.labels(verdict.code).inc()
    return verdict


async def continue_sequence(handoff: HandoffWriter) -> None:
    """Continue the sequence from the saved file's even when nothing saved is applied (no
    --resume, or a refused one), so it stays monotonic across restarts (DESIGN §4)."""
    try:
        raw = await asyncio.to_thread(read_handoff, handoff.path)
        sequence = orjson.loads(raw)["sequence"] if raw else None
    except (UnreadableHandoff, orjson.JSONDecodeError, TypeError, KeyError):
        return
    if sequence is not None and not handoff.continue_numbering(sequence):
        log.warning(
            "handoff: ignoring saved sequence %r (not an integer in [1, %d])",
            sequence,
            MAX_SEQUENCE,
        )
