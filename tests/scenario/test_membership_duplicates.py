"""A source's answer that names one engine twice (the same id at two urls, as a pod found on
two ports would be, or two ids at one url) is refused whole by `Membership.apply`: nothing
changes, rather than one of the two winning by the order of the answer or half the answer
being applied before the conflict shows."""

from __future__ import annotations

import pytest

from narwhal.clock import FakeClock
from narwhal.config import EngineConfig, parse_config
from narwhal.control.membership import Membership, MembershipConflict
from narwhal.fleet.reducer import Policy
from narwhal.fleet.store import Fleet
from narwhal.telemetry.metrics import Metrics

P0 = {"id": "p0", "url": "http://10.0.0.1:8000", "role": "prefill"}


def _membership() -> Membership:
    dns = {"dns": [{"name": "_http._tcp.decode.test", "role": "decode"}]}
    cfg = parse_config({"model": "m", "engines": [P0], "discovery": dns})
    clock = FakeClock()
    fleet = Fleet(cfg.engines, clock, Policy.of(cfg.recovery))
    return Membership(fleet, Metrics(), clock, "vllm", "m", lambda: None)


def _decode(engine_id: str, url: str) -> EngineConfig:
    return EngineConfig(id=engine_id, url=url, role="decode")


@pytest.mark.parametrize(
    ("desired", "says"),
    [
        (
            [_decode("d0.svc", "http://10.0.0.2:8000"), _decode("d0.svc", "http://10.0.0.2:5600")],
            "engine id listed twice: ['d0.svc']",
        ),
        (
            [_decode("d0", "http://10.0.0.2:8000"), _decode("d1", "http://10.0.0.2:8000")],
            "engine url listed twice: ['http://10.0.0.2:8000']",
        ),
    ],
)
def test_an_answer_naming_one_engine_twice_changes_nothing(
    desired: list[EngineConfig], says: str
) -> None:
    membership = _membership()
    with pytest.raises(MembershipConflict) as caught:
        membership.apply(desired, "dns")
    assert str(caught.value) == f"{says} in one answer"
    assert [e.id for e in membership.fleet] == ["p0"]


def test_distinct_engines_are_applied() -> None:
    membership = _membership()
    desired = [_decode("d0", "http://10.0.0.2:8000"), _decode("d1", "http://10.0.0.3:8000")]
    assert membership.apply(desired, "dns").to_json()["added"] == ["d0", "d1"]
    assert sorted(e.id for e in membership.fleet) == ["d0", "d1", "p0"]
