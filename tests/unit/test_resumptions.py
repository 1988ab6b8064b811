"""Restart detection from health answers (engines without a readable process generation)."""

from __future__ import annotations

from narwhal.clock import FakeClock
from narwhal.engine.resumptions import Resumption, Resumptions, restarted_since


def test_only_an_observed_silence_followed_by_an_answer_is_a_restart() -> None:
    clock = FakeClock(wall=100.0)
    seen = Resumptions(clock)
    seen.observe("p0", True)  # first answer: not a restart (the router may just have started)
    clock.advance(1)
    seen.observe("p0", True)
    assert seen.last("p0") is None
    clock.advance(1)  # 102
    seen.observe("p0", False)
    clock.advance(1)
    seen.observe("p0", False)  # the silence started at the first silent check
    assert seen.last("p0") is None
    clock.advance(1)  # 104
    seen.observe("p0", True)
    assert seen.last("p0") == Resumption(102.0, 104.0)
    assert seen.last("p1") is None


def test_a_restart_counts_only_when_the_silence_began_after_the_request() -> None:
    assert restarted_since(Resumption(102.0, 104.0), 101.0)
    assert restarted_since(Resumption(102.0, 104.0), 102.0)
    assert not restarted_since(Resumption(102.0, 104.0), 103.0)  # silent before the request
    assert not restarted_since(None, 0.0)
