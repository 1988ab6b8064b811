"""Ownership on the standby side (DESIGN §5), on a fake clock with a fake `/ready` source.

What counts toward `standby.takeover_threshold` and when the standby acquires (not at
threshold - 1, at the threshold, at once on an expired lease); following the handoff and
ignoring older epochs; the last read of the handoff right after winning the lease; the
refusal line for operator actions on a standby or fenced router. The active is a second
`LeaseKeeper` over the same in-memory store, writing real handoff documents.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from narwhal.clock import FakeClock
from narwhal.config import Config, parse_config
from narwhal.control.lifecycle import Lifecycle
from narwhal.control.ownership import Ownership, counts_toward_takeover
from narwhal.control.stages import consolidation_risk
from narwhal.fleet.holds import HoldName
from narwhal.fleet.store import Fleet
from narwhal.state.handoff import HandoffWriter, build_document
from narwhal.state.lease import LeaseKeeper, Role
from narwhal.telemetry.metrics import Metrics
from tests.support.router import router_config
from tests.unit.test_lease_keeper import MemoryLeaseStore

THRESHOLD = 3
TTL_S = 10.0
ENGINES = [
    {"id": "p0", "url": "http://127.0.0.1:9001", "role": "prefill"},
    {"id": "d0", "url": "http://127.0.0.1:9101", "role": "decode"},
]
DEGRADED = (503, "monitoring degraded: 3 failing passes")


class FakeReady:
    """The active's `/ready` as the standby sees it: (status, body), or None (no answer).
    `before` runs inside the check, i.e. between the standby's follow and its swap."""

    def __init__(self) -> None:
        self.answer: tuple[int, str] | None = (200, "ready")
        self.calls = 0
        self.before: Any = None

    async def __call__(self, url: str) -> tuple[int, str] | None:
        assert url == "http://active.invalid:8000"
        self.calls += 1
        if self.before is not None:
            before, self.before = self.before, None
            await before()
        return self.answer


class Active:
    """router-a: the lease holder, its own fleet, writing epoch-guarded handoff documents."""

    def __init__(self, config: Config, store: MemoryLeaseStore, clock: FakeClock) -> None:
        self.keeper = LeaseKeeper("router-a", config.lease, store, clock)
        self.fleet = Fleet(config.engines, clock)
        self.lifecycle = Lifecycle(self.fleet)
        self.clock = clock
        self.sequence = 0

    def drain(self, engine_id: str) -> None:
        engine = self.fleet.get(engine_id)
        now = self.clock.monotonic()
        self.lifecycle.hold(engine, HoldName.OPERATOR_DRAIN, "operator request", now)

    def document(self, sequence: int, epoch: int) -> dict[str, Any]:
        risk = consolidation_risk(self.fleet, self.clock.monotonic())
        lease = {"backend": "file", "holder": "router-a", "epoch": epoch}
        return build_document(self.fleet, sequence, self.clock.wall(), "router-a", lease, risk)

    async def write(self) -> None:
        self.sequence += 1
        doc = self.document(self.sequence, self.keeper.epoch or 0)
        assert await self.keeper.write_handoff(orjson.dumps(doc))


class Rig:
    def __init__(self, tmp_path: Path) -> None:
        self.config = parse_config(
            router_config(
                ENGINES,
                tmp_path,
                router_id="router-b",
                lease={"backend": "file", "ttl_s": TTL_S, "renew_interval_s": 2.0},
                standby={"active_url": "http://active.invalid:8000",
                         "takeover_threshold": THRESHOLD},
            )
        )  # fmt: skip
        self.clock = FakeClock()
        self.store = MemoryLeaseStore(self.clock)
        self.active = Active(self.config, self.store, self.clock)
        self.ready = FakeReady()
        self.fleet = Fleet(self.config.engines, self.clock)
        self.keeper = LeaseKeeper("router-b", self.config.lease, self.store, self.clock)
        self.handoff = HandoffWriter(
            Path(self.config.handoff.path),
            "router-b",
            self.fleet,
            self.clock,
            risk=lambda: consolidation_risk(self.fleet, self.clock.monotonic()),
            lease=self.keeper.handoff_lease,
        )
        self.ownership = Ownership(
            self.config, self.keeper, self.fleet, self.handoff, Metrics(), self.clock,
            probe_ready=self.ready,
        )  # fmt: skip

    def drained(self) -> bool:
        return HoldName.OPERATOR_DRAIN in self.fleet.get("p0").holds


@pytest.fixture
async def rig(tmp_path: Path) -> Rig:
    r = Rig(tmp_path)
    assert await r.active.keeper.try_acquire(preempt=False)
    await r.ownership.start(standby=True)
    return r


# --------------------------------------------------------------------------- what counts


@pytest.mark.parametrize(
    ("body", "counts"),
    [
        ("monitoring degraded: 3 failing passes", True),
        ("draining: shutting down", True),
        ("", True),
        ("standby: lease held by router-b", False),
        ("standby: waiting out the previous lease", False),
        ("fenced: lease lost to router-b", False),
        ("no capacity: prefill", False),
        ("starting: no verified decode engine", False),
    ],
)
def test_counts_toward_takeover(body: str, counts: bool) -> None:
    assert counts_toward_takeover(body) is counts


# --------------------------------------------------------------------------- the threshold


@pytest.mark.parametrize("answer", [DEGRADED, None], ids=["503", "unreachable"])
async def test_no_takeover_at_threshold_minus_one_takeover_at_the_threshold(
    rig: Rig, answer: tuple[int, str] | None
) -> None:
    rig.ready.answer = answer
    for i in range(1, THRESHOLD):
        await rig.ownership.standby_step()
        assert rig.ownership.active_failures == i
        assert rig.keeper.role is Role.STANDBY
        assert rig.store.record is not None and rig.store.record.holder == "router-a"
    await rig.ownership.standby_step()
    assert rig.ready.calls == THRESHOLD
    assert rig.keeper.role is Role.ACTIVE and rig.keeper.epoch == 2
    assert rig.ownership.active_failures == 0
    # Preempted a live lease: it waits that lease out before admitting.
    reason = rig.keeper.admission_reason(rig.clock.monotonic())
    assert reason == "standby: waiting out the previous lease"


async def test_a_ready_answer_resets_the_count(rig: Rig) -> None:
    for answer in [DEGRADED] * (THRESHOLD - 1) + [(200, "ready")] + [DEGRADED] * (THRESHOLD - 1):
        rig.ready.answer = answer
        await rig.ownership.standby_step()
    assert rig.ownership.active_failures == THRESHOLD - 1
    assert rig.keeper.role is Role.STANDBY


@pytest.mark.parametrize(
    "body", ["standby: lease held by router-b", "fenced: lease lost", "no capacity: decode"]
)
async def test_answers_that_do_not_count_never_take_over(rig: Rig, body: str) -> None:
    rig.ready.answer = (503, body)
    for _ in range(THRESHOLD * 3):
        await rig.ownership.standby_step()
    assert rig.ownership.active_failures == 0
    assert rig.keeper.role is Role.STANDBY


async def test_an_expired_lease_is_taken_at_once_without_failing_checks(rig: Rig) -> None:
    rig.clock.advance(TTL_S)  # router-a stopped renewing; its /ready still says 200
    await rig.ownership.standby_step()
    assert rig.ownership.active_failures == 0
    assert rig.keeper.role is Role.ACTIVE and rig.keeper.epoch == 2
    assert rig.keeper.admission_reason(rig.clock.monotonic()) is None  # nothing to wait out


# --------------------------------------------------------------------------- following


async def test_follow_ignores_a_handoff_from_an_older_epoch(rig: Rig) -> None:
    active = rig.active
    active.drain("p0")
    rig.store.handoff = orjson.dumps(active.document(sequence=5, epoch=2))
    await rig.ownership.follow()
    assert rig.drained()
    assert rig.ownership.followed is not None and rig.ownership.followed["sequence"] == 5
    # An older epoch's writer (a fenced ex-active) with a higher sequence and no drain.
    active.lifecycle.release(
        active.fleet.get("p0"),
        HoldName.OPERATOR_DRAIN,
        "operator undrain",
        active.clock.monotonic(),
    )
    assert active.fleet.get("p0").holds == {}
    rig.store.handoff = orjson.dumps(active.document(sequence=9, epoch=1))
    await rig.ownership.follow()
    assert rig.drained(), "the older epoch's document was applied"
    assert rig.ownership.followed["sequence"] == 5
    # A newer epoch is applied even with a lower sequence.
    rig.store.handoff = orjson.dumps(active.document(sequence=1, epoch=3))
    await rig.ownership.follow()
    assert not rig.drained()
    assert rig.ownership.followed["writer"]["lease_epoch"] == 3


async def test_the_standby_reads_the_handoff_once_more_after_winning(rig: Rig) -> None:
    """The active writes between the standby's last follow and its swap: that document
    (here an operator drain) must survive the takeover."""
    await rig.active.write()
    await rig.ownership.follow()
    assert not rig.drained()
    rig.ready.answer = DEGRADED
    for _ in range(THRESHOLD - 1):
        await rig.ownership.standby_step()

    async def drain_and_write() -> None:
        rig.active.drain("p0")
        await rig.active.write()  # sequence 2, epoch 1: the guard still accepts it

    rig.ready.before = drain_and_write  # runs after this step's follow, before the swap
    await rig.ownership.standby_step()
    assert rig.keeper.role is Role.ACTIVE
    assert rig.drained(), "the drain written just before the takeover was lost"
    assert rig.handoff.sequence == 2
    doc = rig.handoff.document()
    assert (doc["sequence"], doc["writer"]["lease_epoch"]) == (3, 2)
    assert not await rig.active.keeper.write_handoff(b"{}")  # the old holder is refused now


# --------------------------------------------------------------------------- operator refusal


async def test_operator_refusal_names_the_active(rig: Rig) -> None:
    assert rig.ownership.operator_refusal() == (
        "standby: the active is router-a; send operator requests to it"
    )
    rig.clock.advance(TTL_S)
    await rig.ownership.standby_step()
    assert rig.ownership.operator_refusal() is None  # now the active itself
    await rig.active.keeper.renew()  # past its deadline: fenced before it asks the store
    assert rig.active.keeper.role is Role.FENCED
    old = Ownership(
        rig.config, rig.active.keeper, rig.active.fleet, rig.handoff, Metrics(), rig.clock,
        probe_ready=rig.ready,
    )  # fmt: skip
    assert old.operator_refusal() == (  # it has not read the record since: no name yet
        "fenced: lease not renewed in time; the active is unknown; send operator requests to it"
    )
    await rig.active.keeper.observe()  # what its standby step does next
    assert old.operator_refusal() == (
        "fenced: lease not renewed in time; the active is router-b; send operator requests to it"
    )


async def test_a_standby_reports_the_records_time_left(rig: Rig) -> None:
    rig.clock.advance(4.0)
    await rig.keeper.observe()
    view = rig.ownership.to_json()
    assert view["role"] == "standby" and view["holder"] == "router-a"
    assert view["time_left_s"] == pytest.approx(TTL_S - 4.0)
    rig.clock.advance(TTL_S)
    assert rig.ownership.to_json()["time_left_s"] == 0.0
