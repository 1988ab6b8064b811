"""LeaseKeeper decisions (DESIGN §5) on a fake clock and an in-memory lease store.

The store is a compare-and-swap over one record, as the file and etcd stores are; the rules
(epochs, renew deadline, fencing, waiting out a preempted lease, the epoch guard on handoff
writes, the `/ready` lines) are the keeper's and are decided here in virtual time.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from narwhal.clock import FakeClock
from narwhal.config import LeaseConfig
from narwhal.state.lease import (
    AdmissionWindow,
    LeaseKeeper,
    LeaseRecord,
    Role,
    StoreUnavailable,
)

TTL_S = 10.0
RENEW_S = 2.0
DEADLINE_S = 7.5  # the derived default: 0.75 x ttl_s


class MemoryLeaseStore:
    """A LeaseStore in memory: compare-and-swap on the record, the epoch guard on handoffs.

    `down` makes every call raise StoreUnavailable; `call_s` advances the clock during a
    call (a slow store); `log` records the calls.
    """

    def __init__(self, clock: FakeClock | None = None) -> None:
        self.record: LeaseRecord | None = None
        self.handoff: bytes | None = None
        self.down = False
        self.call_s = 0.0
        self.clock = clock
        self.closed = False
        self.log: list[str] = []

    def _call(self, name: str) -> None:
        self.log.append(name)
        if self.clock is not None and self.call_s:
            self.clock.advance(self.call_s)
        if self.down:
            raise StoreUnavailable("memory store is down")

    def _holds(self, holder: str, epoch: int) -> bool:
        return self.record is not None and (self.record.holder, self.record.epoch) == (
            holder,
            epoch,
        )

    async def read(self) -> LeaseRecord | None:
        self._call("read")
        return self.record

    async def swap(self, expected: LeaseRecord | None, record: LeaseRecord) -> bool:
        self._call("swap")
        if self.record != expected:
            return False
        self.record = record
        return True

    async def renew(self, holder: str, epoch: int, expires_at: float) -> bool:
        self._call("renew")
        if not self._holds(holder, epoch):
            return False
        self.record = LeaseRecord(holder, epoch, expires_at)
        return True

    async def write_handoff(self, holder: str, epoch: int, data: bytes) -> bool:
        self._call("write_handoff")
        if not self._holds(holder, epoch):
            return False
        self.handoff = data
        return True

    async def read_handoff(self) -> bytes | None:
        self._call("read_handoff")
        return self.handoff

    async def close(self) -> None:
        self.closed = True


def lease_config(**overrides: float) -> LeaseConfig:
    return LeaseConfig.model_validate(
        {"backend": "file", "ttl_s": TTL_S, "renew_interval_s": RENEW_S, **overrides}
    )


@dataclass
class World:
    clock: FakeClock
    store: MemoryLeaseStore
    a: LeaseKeeper
    b: LeaseKeeper

    def reasons(self) -> tuple[str | None, str | None]:
        now = self.clock.monotonic()
        return self.a.admission_reason(now), self.b.admission_reason(now)


@pytest.fixture
def world() -> World:
    """Two routers on one host (one clock) sharing one store."""
    clock = FakeClock()
    store = MemoryLeaseStore(clock)
    cfg = lease_config()
    assert cfg.effective_renew_deadline_s == DEADLINE_S
    return World(
        clock, store, LeaseKeeper("router-a", cfg, store, clock),
        LeaseKeeper("router-b", cfg, store, clock),
    )  # fmt: skip


# --------------------------------------------------------------------------- epochs


async def test_every_acquisition_raises_the_epoch(world: World) -> None:
    epochs = []
    assert await world.a.try_acquire(preempt=False)
    epochs.append(world.a.epoch)
    world.clock.advance(TTL_S)  # expired: taken without preemption
    assert await world.b.try_acquire(preempt=False)
    epochs.append(world.b.epoch)
    assert await world.a.try_acquire(preempt=True)  # preempting a live lease
    epochs.append(world.a.epoch)
    world.clock.advance(TTL_S)
    assert await world.a.try_acquire(preempt=False)  # the same router again
    epochs.append(world.a.epoch)
    assert epochs == [1, 2, 3, 4]
    assert world.store.record == LeaseRecord("router-a", 4, world.clock.wall() + TTL_S)


async def test_renewal_keeps_the_epoch(world: World) -> None:
    assert await world.a.try_acquire(preempt=False)
    for _ in range(5):
        world.clock.advance(RENEW_S)
        await world.a.renew()
    assert world.a.role is Role.ACTIVE and world.a.epoch == 1
    assert world.store.record == LeaseRecord("router-a", 1, world.clock.wall() + TTL_S)
    assert world.reasons() == (None, "standby: lease held by nobody")


async def test_every_change_of_the_admission_window_is_told_at_once(world: World) -> None:
    """Workers judge by a copy of the window: the keeper tells each acquisition, renewal and
    fencing as it happens, never a failed attempt that changed nothing."""
    told: list[AdmissionWindow] = []
    world.a.on_window = lambda: told.append(world.a.admission_window())
    assert await world.a.try_acquire(preempt=False)
    start = world.clock.monotonic()  # a free lease: admits from its acquisition
    assert told == [AdmissionWindow(None, start + DEADLINE_S, start)]
    world.clock.advance(RENEW_S)
    await world.a.renew()
    assert told[-1] == AdmissionWindow(None, world.clock.monotonic() + DEADLINE_S, start)
    world.store.down = True
    await world.a.renew()  # failed within the deadline: the window stands, nothing told
    assert len(told) == 2
    world.clock.advance(DEADLINE_S)
    await world.a.renew()
    assert told[-1] == AdmissionWindow("fenced: lease lost", None, 0.0)
    assert len(told) == 3


async def test_a_live_lease_is_not_taken_without_preemption(world: World) -> None:
    assert await world.a.try_acquire(preempt=False)
    world.clock.advance(TTL_S - 0.001)
    assert not await world.b.try_acquire(preempt=False)
    assert world.b.role is Role.STANDBY and world.b.epoch is None
    assert world.store.record is not None and world.store.record.holder == "router-a"
    # a did not renew: on its own clock it fenced 2.5 s before the store's expiry.
    assert world.reasons() == (
        "fenced: lease lost",
        "standby: lease held by router-a",
    )


async def test_a_lost_compare_and_swap_is_no_acquisition(world: World) -> None:
    """Two acquirers read the same expired record; only the first swap wins."""
    assert await world.a.try_acquire(preempt=False)
    world.clock.advance(TTL_S)
    c = LeaseKeeper("router-c", lease_config(), world.store, world.clock)
    stale = world.store.record
    assert await world.b.try_acquire(preempt=False)
    assert not await world.store.swap(stale, LeaseRecord("c", 2, 0))
    assert not await c.try_acquire(preempt=False)  # sees b's live record
    assert c.role is Role.STANDBY and world.b.epoch == 2


# --------------------------------------------------------------------------- renew deadline


@pytest.mark.parametrize(
    ("elapsed_s", "fenced"),
    [(RENEW_S, False), (DEADLINE_S - 0.01, False), (DEADLINE_S, True), (TTL_S, True)],
)
async def test_admission_fences_at_the_renew_deadline_on_the_monotonic_clock(
    world: World, elapsed_s: float, fenced: bool
) -> None:
    assert await world.a.try_acquire(preempt=False)
    world.store.down = True  # nothing renews: the keeper decides on its own clock
    world.clock.advance(elapsed_s)
    reason = world.a.admission_reason(world.clock.monotonic())
    assert reason == ("fenced: lease lost" if fenced else None)
    assert world.a.time_left_s(world.clock.monotonic()) == pytest.approx(TTL_S - elapsed_s)


async def test_renew_failures_past_the_deadline_fence(world: World) -> None:
    assert await world.a.try_acquire(preempt=False)
    world.store.down = True
    for _ in range(3):  # at 2, 4, 6 s: failures within the deadline are tolerated
        world.clock.advance(RENEW_S)
        await world.a.renew()
        assert world.a.role is Role.ACTIVE
        assert world.a.store_error == "memory store is down"
        assert world.a.admission_reason(world.clock.monotonic()) is None
    world.clock.advance(RENEW_S)  # 8 s >= 7.5 s
    await world.a.renew()
    assert world.a.role is Role.FENCED
    assert world.a.fence_reason == "lease not renewed in time"
    assert world.reasons()[0] == "fenced: lease lost"
    assert world.a.time_left_s(world.clock.monotonic()) is None
    # Fenced for good: the store coming back does not unfence it; only an acquisition does.
    world.store.down = False
    await world.a.renew()
    assert world.a.role is Role.FENCED


async def test_a_slow_failing_renewal_that_ends_past_the_deadline_fences(world: World) -> None:
    assert await world.a.try_acquire(preempt=False)
    world.clock.advance(6.0)
    world.store.down, world.store.call_s = True, 2.0  # the call itself ends at 8 s
    await world.a.renew()
    assert world.a.role is Role.FENCED
    assert world.a.fence_reason == "lease store unreachable: memory store is down"


async def test_a_slow_renewal_counts_from_its_start(world: World) -> None:
    """Judged from the *start* of the last good renewal: a slow store shortens the lease."""
    assert await world.a.try_acquire(preempt=False)
    world.clock.advance(RENEW_S)
    world.store.call_s = 3.0  # started at 2 s, succeeded at 5 s
    await world.a.renew()
    world.store.call_s = 0.0
    now = world.clock.monotonic()
    assert world.a.role is Role.ACTIVE
    assert world.a.time_left_s(now) == pytest.approx(TTL_S - 3.0)
    world.clock.advance(DEADLINE_S - 3.0)  # 7.5 s after the renewal's start
    assert world.a.admission_reason(world.clock.monotonic()) == "fenced: lease lost"


async def test_check_deadline_fences(world: World) -> None:
    assert await world.a.try_acquire(preempt=False)
    world.a.check_deadline(world.clock.monotonic() + DEADLINE_S - 0.01)
    assert world.a.role is Role.ACTIVE
    world.a.check_deadline(world.clock.monotonic() + DEADLINE_S)
    assert world.a.role is Role.FENCED and world.a.fence_reason == "lease not renewed in time"


# --------------------------------------------------------------------------- other holders


async def test_another_holder_fences_at_the_next_renewal(world: World) -> None:
    assert await world.a.try_acquire(preempt=False)
    world.clock.advance(1.0)
    assert await world.b.try_acquire(preempt=True)
    await world.a.renew()  # well within a's deadline: fenced at once all the same
    assert world.a.role is Role.FENCED
    assert world.a.fence_reason == "lease lost to router-b"
    assert world.a.admission_reason(world.clock.monotonic()) == "fenced: lease lost"
    assert world.a.last_seen is not None and world.a.last_seen.holder == "router-b"
    assert world.store.record is not None and world.store.record.epoch == 2


async def test_a_newer_epoch_of_the_same_holder_fences_the_old_one(world: World) -> None:
    """A restarted router-a took epoch 2: the old router-a process (epoch 1) must fence."""
    assert await world.a.try_acquire(preempt=False)
    again = LeaseKeeper("router-a", lease_config(), world.store, world.clock)
    world.clock.advance(1.0)
    assert await again.try_acquire(preempt=True)
    await world.a.renew()
    assert world.a.role is Role.FENCED
    assert world.a.fence_reason == "lease lost to router-a"
    assert not await world.a.write_handoff(b"{}")


async def test_a_refused_handoff_write_fences(world: World) -> None:
    assert await world.a.try_acquire(preempt=False)
    assert await world.a.write_handoff(b"epoch-1")
    assert await world.b.try_acquire(preempt=True)
    assert not await world.a.write_handoff(b"old writer")
    assert world.a.role is Role.FENCED
    assert world.a.fence_reason == "handoff write refused by the epoch guard"
    assert world.store.handoff == b"epoch-1"
    assert await world.b.write_handoff(b"epoch-2")
    assert world.store.handoff == b"epoch-2"


@pytest.mark.parametrize(
    ("holder", "epoch", "accepted"),
    [("router-a", 2, True), ("router-a", 1, False), ("router-b", 2, False),
     ("router-b", 1, False), ("router-a", 3, False)],
)  # fmt: skip
async def test_the_store_refuses_writes_from_any_other_epoch(
    holder: str, epoch: int, accepted: bool
) -> None:
    store = MemoryLeaseStore()
    store.record = LeaseRecord("router-a", 2, 1e12)
    assert await store.write_handoff(holder, epoch, b"doc") is accepted
    assert await store.renew(holder, epoch, 2e12) is accepted
    assert store.handoff == (b"doc" if accepted else None)


async def test_a_standby_and_a_fenced_router_never_write(world: World) -> None:
    assert not await world.b.write_handoff(b"standby")
    assert await world.a.try_acquire(preempt=False)
    assert await world.b.try_acquire(preempt=True)
    await world.a.renew()
    world.store.log.clear()
    assert not await world.a.write_handoff(b"fenced")
    assert world.store.log == []  # refused locally, the store is not even asked


async def test_a_store_error_on_a_handoff_write_propagates_without_fencing(world: World) -> None:
    assert await world.a.try_acquire(preempt=False)
    world.store.down = True
    with pytest.raises(StoreUnavailable):
        await world.a.write_handoff(b"doc")
    assert world.a.role is Role.ACTIVE and world.a.store_error == "memory store is down"


# --------------------------------------------------------------------------- preemption


async def test_a_preempting_acquirer_waits_out_the_previous_lease(world: World) -> None:
    assert await world.a.try_acquire(preempt=False)
    world.clock.advance(3.0)  # a's lease has 7 s left on the store's clock
    assert await world.b.try_acquire(preempt=True)
    assert world.b.role is Role.ACTIVE and world.b.epoch == 2
    waited = 0.0
    while world.b.admission_reason(world.clock.monotonic()) is not None:
        assert world.b.admission_reason(world.clock.monotonic()) == (
            "standby: waiting out the previous lease"
        )
        world.clock.advance(0.05)
        waited += 0.05
    assert waited == pytest.approx(TTL_S - 3.0, abs=0.051)


async def test_an_expired_lease_is_taken_without_waiting(world: World) -> None:
    assert await world.a.try_acquire(preempt=False)
    world.clock.advance(TTL_S)
    assert await world.b.try_acquire(preempt=False)
    assert world.reasons() == ("fenced: lease lost", None)


async def test_preemption_never_lets_both_admit(world: World) -> None:
    """Step virtual time through a preemption: at no instant do two keepers admit."""
    assert await world.a.try_acquire(preempt=False)
    admitted: list[tuple[float, str]] = []
    for step in range(400):  # 20 s in 50 ms steps
        t = step * 0.05
        if step and step % 40 == 0:  # both renew every 2 s (a learns of b at its renewal)
            await world.a.renew()
            await world.b.renew()
        if step == 50:
            assert await world.b.try_acquire(preempt=True)
        reason_a, reason_b = world.reasons()
        assert reason_a is not None or reason_b is not None, f"both admit at {t:.2f}s"
        admitted += [(t, name) for name, r in (("a", reason_a), ("b", reason_b)) if r is None]
        world.clock.advance(0.05)
    owners = [name for _, name in admitted]
    assert owners[0] == "a" and owners[-1] == "b"
    handover = next(i for i, name in enumerate(owners) if name == "b")
    assert set(owners[handover:]) == {"b"}


class RenewDuringSwap(MemoryLeaseStore):
    """The holder's renewal lands between an acquirer's read and its swap (slow store)."""

    def __init__(self, clock: FakeClock, lag_s: float) -> None:
        super().__init__(clock)
        self.holder: LeaseKeeper | None = None
        self.lag_s = lag_s

    async def swap(self, expected: LeaseRecord | None, record: LeaseRecord) -> bool:
        if self.holder is not None:
            holder, self.holder = self.holder, None  # only the first swap is interleaved
            assert self.clock is not None
            self.clock.advance(self.lag_s)
            await holder.renew()
            assert holder.role is Role.ACTIVE
        return await super().swap(expected, record)


async def test_a_renewal_inside_the_preempting_swap_never_lets_both_admit() -> None:
    """ttl 10 / renew 8 (deadline 9): the holder renews while the standby's swap is in
    flight. The standby must not wait out only the expiry it read before the renewal."""
    clock = FakeClock()
    store = RenewDuringSwap(clock, lag_s=1.0)
    cfg = lease_config(renew_interval_s=8.0)
    assert cfg.effective_renew_deadline_s == 9.0
    a = LeaseKeeper("router-a", cfg, store, clock)
    b = LeaseKeeper("router-b", cfg, store, clock)
    t0 = clock.monotonic()
    assert await a.try_acquire(preempt=False)
    clock.advance(7.0)  # b reads a's record (expiring at 10 s) at 7 s...
    store.holder = a  # ...and a renews at 8 s, before b's swap lands
    a_renews_at, b_tries_at = 8.0 + 8.0, 7.0
    both: list[float] = []
    while clock.monotonic() - t0 < 40.0:
        t = clock.monotonic() - t0
        if b.role is not Role.ACTIVE and t >= b_tries_at:
            await b.try_acquire(preempt=True)  # a standby step, every 0.5 s
            b_tries_at = t + 0.5
        if t >= a_renews_at:
            await a.renew()
            await b.renew()
            a_renews_at = t + 8.0
        now = clock.monotonic()
        ra, rb = a.admission_reason(now), b.admission_reason(now)
        if ra is None and rb is None:
            both.append(round(t, 2))
        clock.advance(0.05)
    assert both == [], f"both admit from {both[0]}s to {both[-1]}s"
    assert b.role is Role.ACTIVE and b.admission_reason(clock.monotonic()) is None
    assert a.role is Role.FENCED


async def test_a_paused_holder_cannot_admit_when_it_resumes(world: World) -> None:
    """SIGSTOP: nothing runs, the monotonic clock goes on; on resume the deadline has passed."""
    assert await world.a.try_acquire(preempt=False)
    world.clock.advance(TTL_S + 5.0)  # frozen: no renewals, no loops
    assert await world.b.try_acquire(preempt=False)
    assert world.reasons() == ("fenced: lease lost", None)
    await world.a.renew()
    assert world.a.role is Role.FENCED and world.a.fence_reason == "lease not renewed in time"


async def test_past_the_renew_deadline_the_holder_stops_writing_the_handoff(
    world: World,
) -> None:
    assert await world.a.try_acquire(preempt=False)
    world.clock.advance(DEADLINE_S + 0.1)  # e.g. resumed after a pause, before its next renew
    assert world.a.admission_reason(world.clock.monotonic()) is not None
    assert not await world.a.write_handoff(b"written after the deadline")
    assert world.store.handoff is None


# --------------------------------------------------------------------------- clocks


@pytest.mark.parametrize("skew_s", [0.0, 1.0, TTL_S - DEADLINE_S - 0.01])
async def test_wall_clock_skew_below_the_fencing_margin_is_safe(skew_s: float) -> None:
    """Acquirers judge expiry on their wall clock; the holder fences on its monotonic clock
    `ttl_s - renew_deadline_s` earlier. A standby's clock ahead by less than that is safe."""
    clock_a = FakeClock()
    clock_b = FakeClock(wall=clock_a.wall() + skew_s)
    store = MemoryLeaseStore()
    a = LeaseKeeper("router-a", lease_config(), store, clock_a)
    b = LeaseKeeper("router-b", lease_config(), store, clock_b)
    assert await a.try_acquire(preempt=False)
    for _ in range(220):  # 11 s, a frozen from the start: b takes over when it can
        for clock in (clock_a, clock_b):
            clock.advance(0.05)
        if b.role is not Role.ACTIVE:
            await b.try_acquire(preempt=False)
        both = a.admission_reason(clock_a.monotonic()) is None and (
            b.admission_reason(clock_b.monotonic()) is None
        )
        assert not both
    assert b.role is Role.ACTIVE


async def test_wall_clock_skew_beyond_the_margin_breaks_the_guarantee() -> None:
    """The documented limit (docs/lease.md): a standby clock ahead by more than
    `ttl_s - renew_deadline_s` can take a lease while its holder still admits."""
    clock_a = FakeClock()
    clock_b = FakeClock(wall=clock_a.wall() + (TTL_S - DEADLINE_S) + 1.0)
    store = MemoryLeaseStore()
    a = LeaseKeeper("router-a", lease_config(), store, clock_a)
    b = LeaseKeeper("router-b", lease_config(), store, clock_b)
    assert await a.try_acquire(preempt=False)
    for clock in (clock_a, clock_b):
        clock.advance(DEADLINE_S - 1.0)
    assert await b.try_acquire(preempt=False)  # expired on b's clock
    assert a.admission_reason(clock_a.monotonic()) is None
    assert b.admission_reason(clock_b.monotonic()) is None


# --------------------------------------------------------------------------- views


async def test_admission_reason_lines(world: World) -> None:
    assert world.reasons() == ("standby: lease held by nobody",) * 2
    assert await world.a.try_acquire(preempt=False)
    await world.b.observe()
    assert world.reasons() == (None, "standby: lease held by router-a")
    world.clock.advance(1.0)
    assert await world.b.try_acquire(preempt=True)
    assert world.reasons() == (None, "standby: waiting out the previous lease")
    await world.a.renew()
    assert world.reasons() == ("fenced: lease lost", "standby: waiting out the "
                               "previous lease")  # fmt: skip
    world.clock.advance(TTL_S)
    assert world.reasons()[1] == "fenced: lease lost"


async def test_to_json_and_the_handoff_lease(world: World) -> None:
    assert world.a.handoff_lease() is None
    assert await world.a.try_acquire(preempt=False)
    now = world.clock.monotonic()
    assert world.a.to_json(now) == {
        "backend": "file", "router_id": "router-a", "role": "active", "holder": "router-a",
        "epoch": 1, "my_epoch": 1, "time_left_s": TTL_S, "fence_reason": None,
        "store_error": None, "admitting": True,
    }  # fmt: skip
    assert world.a.handoff_lease() == {"backend": "file", "holder": "router-a", "epoch": 1}
    world.store.down = True
    assert not await world.b.try_acquire(preempt=True)
    view = world.b.to_json(now)
    assert view["role"] == "standby" and view["store_error"] == "memory store is down"
    assert view["admitting"] is False and view["time_left_s"] is None


async def test_observe_keeps_the_last_record_while_the_store_is_down(world: World) -> None:
    assert await world.a.try_acquire(preempt=False)
    seen = await world.b.observe()
    world.store.down = True
    assert await world.b.observe() == seen
    assert world.b.store_error == "memory store is down"
    world.store.down = False
    assert await world.b.observe() == seen and world.b.store_error is None


async def test_release_lets_a_standby_take_over_at_once(world: World) -> None:
    assert await world.a.try_acquire(preempt=False)
    world.clock.advance(1.0)
    await world.a.release()
    assert await world.b.try_acquire(preempt=False)  # expired: no preemption, no wait
    assert world.reasons()[1] is None
    assert world.b.epoch == 2
