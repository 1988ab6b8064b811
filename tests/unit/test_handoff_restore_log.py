"""Restoring a handoff document is one `Restored` event per engine through `Fleet.apply`
(DESIGN §8 house style): each engine whose ejection, holds or verification change is logged
`from -> to (reason)` and counted in `narwhal_engine_transitions_total`; re-applying what is
already there (a standby following every write) logs and counts nothing.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from narwhal.clock import FakeClock
from narwhal.fleet.holds import HoldName
from narwhal.state.handoff import apply_document, check_document
from tests.unit.test_handoff_document import SCHEMA_JSON, Rig, encode, make_config

REASON = "restored from the handoff document"


def checked(doc: dict[str, Any], rig: Rig) -> dict[str, Any]:
    verdict = check_document(encode(doc), rig.config, SCHEMA_JSON)
    assert verdict.ok and verdict.document is not None, verdict.reason
    return verdict.document


def lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The restore's transition lines (the saving rig's own changes log too)."""
    messages = (r.getMessage() for r in caplog.records if r.name == "narwhal.fleet")
    return sorted(m for m in messages if REASON in m)


def test_restoring_logs_and_counts_each_change_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = make_config(tmp_path)
    saved = Rig(config)
    saved.populate()
    doc = checked(saved.build(), saved)
    fresh = Rig(config, FakeClock(monotonic=50.0, wall=saved.clock.wall() + 1.0))

    caplog.set_level(logging.INFO, logger="narwhal.fleet")
    apply_document(doc, fresh.fleet, fresh.clock)
    # A new process starts every engine unverified (DESIGN §10); the document restores what
    # the saving router knew, verification included, so every engine changes once.
    assert lines(caplog) == [
        f"engine d0: unverified -> held(planned_maintenance) ({REASON})",
        f"engine d1: unverified -> ejected ({REASON})",
        f"engine d2: unverified -> ejected ({REASON})",
        f"engine d3: unverified -> in-service ({REASON})",
        f"engine p0: unverified -> in-service ({REASON})",
        f"engine p1: unverified -> held(operator_drain) ({REASON})",
        f"engine p2: unverified -> held(inference_verification,performance_drift) ({REASON})",
    ]

    def transitions(engine: str, to: str) -> float | None:
        return fresh.metrics.registry.get_sample_value(
            "narwhal_engine_transitions_total", {"engine": engine, "to": to}
        )

    assert transitions("p1", "held") == 1 and transitions("d1", "ejected") == 1
    assert transitions("p0", "held") is None and transitions("d3", "in-service") == 1

    # A standby re-applying the same document: nothing changed, nothing logged or counted.
    caplog.clear()
    apply_document(doc, fresh.fleet, fresh.clock)
    assert lines(caplog) == []
    assert transitions("p1", "held") == 1

    # The active released p1's drain: the next document takes it back into service.
    saved.lifecycle.release(
        saved.fleet.get("p1"), HoldName.OPERATOR_DRAIN, "operator", saved.clock.monotonic()
    )
    apply_document(checked(saved.build(sequence=8), saved), fresh.fleet, fresh.clock)
    assert lines(caplog) == [f"engine p1: held(operator_drain) -> in-service ({REASON})"]
    assert transitions("p1", "in-service") == 1
