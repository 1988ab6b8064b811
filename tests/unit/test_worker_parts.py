"""The pure parts of data-plane workers (DESIGN §9), each on its own.

- `fleet.codec`: an `EngineState` survives `encode`/`decode` exactly, also through orjson;
- `FleetReplica`: loaded from decoded snapshots it answers every placement and `/ready` read
  as the control process's `Fleet` does, at any `now`; it refuses events and unknown engines;
- `process.table`: the shared counts table, its `SharedInFlight`, and a second mapping of the
  same memfd seeing the writes;
- `process.gate`: `closed_reason_at`'s precedence, `GateData`'s JSON round trip, and
  `WorkerGate.ready` following `ready_reason` after the worker's own reasons;
- `process.supervisor`'s helpers: restart backoff, connection shares, the control window and
  the sweep of stale runtime directories;
- `serving.workers` in the config and `Config.resolved_workers`;
- shipping a worker's interval and timeline counts (`take`, sparse buckets, `merge`) equals
  observing them directly;
- the data plane's metrics registry and the control process's are disjoint, and `render`
  covers both.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from narwhal.clock import FakeClock
from narwhal.config import Config, ConfigError, EngineConfig, Role, parse_config
from narwhal.dataplane.placement import least_in_flight
from narwhal.engine.failures import FailureClass
from narwhal.fleet.codec import decode, encode
from narwhal.fleet.events import EjectRequested, HealthOk, VerificationSeen
from narwhal.fleet.holds import Hold, HoldName
from narwhal.fleet.inflight import Choose, InFlight
from narwhal.fleet.intervals import Histogram, IntervalStats
from narwhal.fleet.readiness import starting_reason
from narwhal.fleet.replica import FleetReplica
from narwhal.fleet.state import Candidate, Ejection, EngineState
from narwhal.fleet.store import Fleet
from narwhal.process.gate import (
    CONTROL_LOST,
    DRAINING,
    GateData,
    WorkerGate,
    closed_reason_at,
)
from narwhal.process.supervisor import (
    control_window_s,
    restart_delay_s,
    shares,
    sweep_stale_runtime_dirs,
)
from narwhal.process.table import CHAT, COMPLETIONS, SharedInFlight, WorkerTable
from narwhal.state.lease import FENCED_LINE, AdmissionWindow
from narwhal.telemetry.metrics import DataMetrics, Metrics
from narwhal.telemetry.timeline import Timeline
from tests.support.fleet import force_state

BASE: dict[str, Any] = {
    "model": "demo-model",
    "engines": [
        {"id": "p0", "url": "http://127.0.0.1:9001", "role": "prefill"},
        {"id": "d0", "url": "http://127.0.0.1:9101", "role": "decode"},
        {"id": "b0", "url": "http://127.0.0.1:9201", "role": "both"},
    ],
}
ENGINES = parse_config(BASE).engines
IDS = [e.id for e in ENGINES]


def config(*, api: str = "vllm", **serving: Any) -> Config:
    return parse_config(
        {**BASE, "engines": [{**e, "api": api} for e in BASE["engines"]], "serving": serving}
    )


def problems_of(data: dict[str, Any]) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        parse_config(data)
    return caught.value.problems


# --------------------------------------------------------------------------- strategies
TEXT = st.text(st.characters(codec="utf-8"), max_size=12)
FLOAT = st.floats(min_value=-1e12, max_value=1e12, allow_nan=False)
COUNT = st.integers(min_value=0, max_value=2**40)
DEADLINE = st.floats(min_value=0.0, max_value=100.0, allow_nan=False)


def _as_map(holds: list[Hold]) -> dict[HoldName, Hold]:
    return {h.name: h for h in holds}


HOLDS = st.lists(
    st.builds(
        Hold,
        name=st.sampled_from(HoldName),
        reason=TEXT,
        since_wall=FLOAT,
        deadline_mono=st.none() | DEADLINE,
        deadline_wall=st.none() | FLOAT,
        newer_than=st.none() | FLOAT,
    ),
    unique_by=lambda h: h.name,
).map(_as_map)

EJECTIONS = st.builds(
    Ejection,
    cause=st.sampled_from([*(c.value for c in FailureClass), "liveness"]),
    reason=TEXT,
    at_wall=FLOAT,
    evidence=st.dictionaries(st.sampled_from([c.value for c in FailureClass]), COUNT),
)


def states_of(engine: EngineConfig) -> st.SearchStrategy[EngineState]:
    return st.builds(
        EngineState,
        config=st.just(engine),
        role=st.sampled_from(Role),
        evidence=st.dictionaries(st.sampled_from(FailureClass), COUNT),
        liveness_misses=COUNT,
        ejected=st.none() | EJECTIONS,
        holds=HOLDS,
        generation=st.none() | FLOAT,
        max_model_len=st.none() | COUNT,
        verified=st.booleans(),
        unverified_reason=st.none() | TEXT,
    )


FLEET_STATES = st.tuples(*(states_of(e) for e in ENGINES))


def shipped(state: EngineState) -> EngineState:
    """`state` as a worker gets it: encoded, through the socket's JSON, decoded."""
    return decode(orjson.loads(orjson.dumps(encode(state))), state.config)


# --------------------------------------------------------------------------- codec
@settings(max_examples=100, deadline=None)
@given(states_of(ENGINES[2]))
def test_codec_round_trip_is_exact(state: EngineState) -> None:
    data = encode(state)
    assert orjson.loads(orjson.dumps(data)) == data  # plain JSON data, nothing lost to orjson
    assert decode(data, state.config) == state
    assert shipped(state) == state


def test_codec_decodes_enums_and_records_not_strings() -> None:
    hold = Hold(HoldName.PLANNED_MAINTENANCE, "upgrade", 1.0, 50.0, 2.0, 7.0)
    state = EngineState(
        config=ENGINES[0],
        role=Role.DECODE,
        evidence={FailureClass.KV_HANDOFF: 2},
        ejected=Ejection("connection", "refused", 3.0, {"connection": 3}),
        holds={HoldName.PLANNED_MAINTENANCE: hold},
    )
    got = shipped(state)
    assert got.role is Role.DECODE
    # A StrEnum equals its value, so `==` alone would pass plain strings: check the types.
    assert [type(c) for c in got.evidence] == [FailureClass]
    assert [(type(n), type(h.name)) for n, h in got.holds.items()] == [(HoldName, HoldName)]
    assert got.holds[HoldName.PLANNED_MAINTENANCE] == hold
    assert isinstance(got.ejected, Ejection)
    assert got.config is ENGINES[0]  # the receiver's own config, rebound by id


# --------------------------------------------------------------------------- replica
def fleets(states: Sequence[EngineState]) -> tuple[Fleet, FleetReplica]:
    """The control process's fleet forced to `states`, and a replica loaded from them as
    shipped over the channel."""
    fleet = Fleet(ENGINES, FakeClock())
    for state in states:
        force_state(
            fleet,
            state.id,
            **{f.name: getattr(state, f.name) for f in fields(state) if f.name != "config"},
        )
    replica = FleetReplica(ENGINES, FakeClock())
    replica.load(shipped(s) for s in states)
    return fleet, replica


def moments(states: Sequence[EngineState]) -> list[float]:
    """`now` values on both sides of (and at) every hold deadline, and far before and after."""
    deadlines = {
        h.deadline_mono for s in states for h in s.holds.values() if h.deadline_mono is not None
    }
    return sorted({-1.0, 1e9, *(d + e for d in deadlines for e in (-0.25, 0.0, 0.25))})


@settings(max_examples=100, deadline=None)
@given(FLEET_STATES)
def test_replica_answers_every_read_as_the_fleet(states: tuple[EngineState, ...]) -> None:
    fleet, replica = fleets(states)
    assert list(replica) == list(fleet) == list(states)
    assert replica.needed_roles() == fleet.needed_roles()
    assert replica.roles_without_verified() == fleet.roles_without_verified()
    for role in Role:
        assert replica.has_verified(role) == fleet.has_verified(role)
    for now in moments(states):
        for role in Role:
            assert replica.candidates(role, now) == fleet.candidates(role, now), (role, now)
            assert replica.verification_peers(role, now) == fleet.verification_peers(role, now)
        for engine_id in IDS:
            assert replica.eligible(replica.get(engine_id), now) == fleet.eligible(
                fleet.get(engine_id), now
            ), (engine_id, now)


def test_replica_load_replaces_only_the_named_engines() -> None:
    replica = FleetReplica(ENGINES, FakeClock())
    before = replica.get("p0")
    verified = EngineState(config=ENGINES[1], role=Role.DECODE, verified=True)
    replica.load([verified])
    assert replica.get("d0") == verified
    assert replica.get("p0") is before
    assert replica.roles_without_verified() == [Role.PREFILL]


def test_replica_refuses_events() -> None:
    replica = FleetReplica(ENGINES, FakeClock())
    before = list(replica)
    with pytest.raises(TypeError):
        replica.apply(HealthOk("p0"), 0.0)
    assert list(replica) == before


# --------------------------------------------------------------------------- shared table
def test_table_rows_add_sum_and_zero() -> None:
    table = WorkerTable.create(3)
    try:
        assert [table.get(r, c) for r in range(3) for c in range(table.width)] == [0] * (
            3 * table.width
        )
        table.add(0, COMPLETIONS, 2)
        table.add(2, COMPLETIONS, 5)
        table.add(1, CHAT, 1)
        table.add(2, COMPLETIONS, -1)
        assert (table.get(0, COMPLETIONS), table.get(2, COMPLETIONS)) == (2, 4)
        assert table.total(COMPLETIONS) == 6
        assert table.total(CHAT) == 1
        table.zero(2)
        assert [table.get(2, c) for c in range(table.width)] == [0] * table.width
        assert table.total(COMPLETIONS) == 2
        assert table.get(1, CHAT) == 1  # other rows untouched
    finally:
        table.close()


def _members(
    table: WorkerTable,
    rows: Sequence[int],
    ids: Sequence[str] = IDS,
    columns: dict[str, int] | None = None,
) -> tuple[SharedInFlight, list[SharedInFlight]]:
    """The control process's counts with a column per member (or the given `columns`), and
    each worker's, bound to the same columns (as the snapshots tell them)."""
    control = SharedInFlight(table, None)
    for engine_id in ids:
        if columns is None:
            control.add(engine_id)
        else:
            control.bind(engine_id, columns[engine_id])
    workers = []
    for row in rows:
        worker = SharedInFlight(table, row)
        for engine_id, column in control.columns.items():
            worker.bind(engine_id, column)
        workers.append(worker)
    return control, workers


def test_shared_in_flight_writes_its_row_and_reads_every_row() -> None:
    table = WorkerTable.create(2)
    try:
        control, (w0, w1) = _members(table, (0, 1))
        w0.enter("d0")
        w0.enter("d0")
        w1.enter("d0")
        w1.enter("b0")
        w0.leave("d0")
        assert table.get(0, control.columns["d0"]) == 1
        assert table.get(1, control.columns["d0"]) == 1
        assert [control.of(e) for e in IDS] == [0, 2, 1]
        assert w0.of("d0") == w1.of("d0") == 2
        with pytest.raises(AssertionError):
            control.enter("d0")
        with pytest.raises(AssertionError):
            control.leave("d0")
        assert control.of("d0") == 2
    finally:
        table.close()


def _least_of(counts: SharedInFlight | InFlight, ids: Sequence[str]) -> Choose:
    return lambda turn: least_in_flight([Candidate(e, counts.of(e)) for e in ids], turn)


def test_a_claim_in_one_worker_is_seen_by_the_next_claim_in_another() -> None:
    """Two workers placing at once land on different engines, and the rotation is the
    router's: alternate workers alternate engines, as one process would."""
    table = WorkerTable.create(2)
    try:
        control, (w0, w1) = _members(table, (0, 1))
        pair = ["b0", "p0"]
        assert w0.claim("prefill", _least_of(w0, pair)) == "b0"
        assert w1.claim("prefill", _least_of(w1, pair)) == "p0"  # b0 is w0's, in flight
        w0.leave("b0")
        w1.leave("p0")
        picks = []
        for worker in (w0, w1, w0, w1):
            engine_id = worker.claim("prefill", _least_of(worker, pair))
            assert engine_id is not None
            picks.append(engine_id)
            worker.leave(engine_id)
        assert picks == ["b0", "p0", "b0", "p0"]
        assert w0.claim("decode", _least_of(w0, pair)) == "b0"  # each role its own turn
        assert w0.claim("both", lambda turn: None) is None
        assert table.get(0, control.columns["b0"]) == 1
    finally:
        table.close()


def test_in_process_claims_rotate_per_role() -> None:
    counts = InFlight(IDS)
    pair = ["b0", "p0"]
    picks = []
    for _ in range(3):
        engine_id = counts.claim("prefill", _least_of(counts, pair))
        assert engine_id is not None
        picks.append(engine_id)
        counts.leave(engine_id)
    assert picks == ["b0", "p0", "b0"]
    assert counts.claim("decode", _least_of(counts, pair)) == "b0"
    assert counts.of("b0") == 1


def _claim_many(fd: int, row: int, n: int, out: Path, columns: dict[str, int]) -> None:
    """Claim `n` times (never leaving), and write down every turn handed out."""
    table = WorkerTable(fd, 2)
    _, (counts,) = _members(table, (row,), columns=columns)
    turns = []
    least = _least_of(counts, IDS)

    def choose(turn: int) -> str | None:
        turns.append(turn)
        return least(turn)

    for _ in range(n):
        counts.claim("decode", choose)
    out.write_text(" ".join(map(str, turns)))


def test_claims_from_two_processes_at_once_are_one_step_each(tmp_path: Path) -> None:
    """Two processes claim as fast as they can: every turn is handed out exactly once (a
    claim's read and write are one step), and the counts stay balanced."""
    table = WorkerTable.create(2)
    n = 20_000
    pids = []
    control, _ = _members(table, ())
    try:
        for row in (0, 1):
            pid = os.fork()
            if pid == 0:  # pragma: no cover - the child
                code = 1
                try:
                    _claim_many(table.fd, row, n, tmp_path / f"turns{row}", control.columns)
                    code = 0
                finally:
                    os._exit(code)
            pids.append(pid)
        for pid in pids:
            assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
        turns = [int(t) for row in (0, 1) for t in (tmp_path / f"turns{row}").read_text().split()]
        assert sorted(turns) == list(range(2 * n))
        totals = [control.of(e) for e in IDS]
        assert sum(totals) == 2 * n
        assert max(totals) - min(totals) <= 1, totals
    finally:
        table.close()


def test_a_second_mapping_of_the_memfd_sees_the_writes() -> None:
    table = WorkerTable.create(2)
    other = WorkerTable(os.dup(table.fd), 2)
    try:
        control, (worker,) = _members(table, (0,))
        worker.enter("p0")
        other.add(1, COMPLETIONS, 3)  # as a worker would, in its own process
        reader, _ = _members(other, (), columns=control.columns)
        assert reader.of("p0") == 1
        assert table.total(COMPLETIONS) == 3
        table.zero(1)
        assert other.get(1, COMPLETIONS) == 0
    finally:
        other.close()
        table.close()


def test_a_column_is_reused_only_once_the_legs_of_the_engine_that_left_have_finished() -> None:
    """A removed engine's column stays counted while a worker's legs on it run (the worker
    keeps it, retired), so a member that joins meanwhile gets another column."""
    table = WorkerTable.create(1)
    try:
        control, (worker,) = _members(table, (0,), ["a"])
        worker.enter("a")
        control.remove("a")
        worker.remove("a")
        control.add("b")
        first_column = control_first = worker.columns.get("a", None) or _first_column(table)
        assert control_first == first_column
        assert control.columns["b"] == first_column + 1  # "a"'s column still counts
        worker.leave("a")  # the leg that outlived the removal
        assert table.total(first_column) == 0
        control.add("c")
        assert control.columns["c"] == first_column  # now free again
    finally:
        table.close()


def _first_column(table: WorkerTable) -> int:
    return table.width - table.engine_columns


def test_a_table_has_room_for_engine_columns_members_and_no_more() -> None:
    table = WorkerTable.create(1, engine_columns=2)
    try:
        control, _ = _members(table, (), ["a", "b"])
        with pytest.raises(ValueError, match="no room"):
            control.add("c")
        control.remove("a")
        control.add("c")
    finally:
        table.close()


def test_a_replica_takes_joins_and_leaves_from_snapshots() -> None:
    clock = FakeClock()
    replica = FleetReplica((), clock)
    p0, d0 = (EngineState(config=e, role=e.role) for e in ENGINES[:2])
    replica.load([p0, d0], full=True)
    assert [e.id for e in replica] == ["p0", "d0"]
    replica.load([], gone=["d0"])
    assert [e.id for e in replica] == ["p0"]
    replica.load([d0], full=True)  # a full snapshot drops whatever it does not name
    assert [e.id for e in replica] == ["d0"]
    assert replica.in_flight.of("p0") == 0


# --------------------------------------------------------------------------- gate
STANDBY = "standby: waiting out the previous lease"
MONITOR = "monitoring degraded: no pass for 9 s"
OPEN = AdmissionWindow(None, fence_at=110.0, admit_after=90.0)


def gate(lease: AdmissionWindow | None = None, monitor: str | None = None) -> GateData:
    return GateData(lease, monitor, valid_until=120.0)


GATE_CASES = [
    ("no-data", None, 100.0, False, False, CONTROL_LOST),
    ("lost", gate(), 100.0, True, False, CONTROL_LOST),
    ("lost-beats-draining", gate(), 100.0, True, True, CONTROL_LOST),
    ("stale-at-valid-until", gate(), 120.0, False, False, CONTROL_LOST),
    ("stale-beats-draining", gate(None, MONITOR), 121.0, False, True, CONTROL_LOST),
    ("lease-beats-stale", gate(OPEN, MONITOR), 121.0, False, False, FENCED_LINE),
    ("lease-beats-lost", gate(OPEN), 111.0, True, False, FENCED_LINE),
    ("fresh-just-before", gate(), 119.99, False, False, None),
    ("lease-beats-draining", gate(AdmissionWindow("fenced: lease lost", None, 0.0)), 100.0,
     False, True, "fenced: lease lost"),
    ("draining-beats-monitor", gate(OPEN, MONITOR), 100.0, False, True, DRAINING),
    ("static-lease", gate(AdmissionWindow("standby: lease held by b", None, 0.0), MONITOR),
     100.0, False, False, "standby: lease held by b"),
    ("fence-at-reached", gate(OPEN, MONITOR), 110.0, False, False, FENCED_LINE),
    ("fence-beats-standby", gate(AdmissionWindow(None, 80.0, 90.0)), 85.0, False, False,
     FENCED_LINE),
    ("before-admit-after", gate(OPEN, MONITOR), 89.9, False, False, STANDBY),
    ("admit-after-reached", gate(OPEN), 90.0, False, False, None),
    ("lease-open-then-monitor", gate(OPEN, MONITOR), 100.0, False, False, MONITOR),
    ("no-lease-monitor", gate(None, MONITOR), 100.0, False, False, MONITOR),
    ("no-fence-deadline", gate(AdmissionWindow(None, None, 0.0)), 119.0, False, False, None),
]  # fmt: skip


@pytest.mark.parametrize(
    ("data", "now", "lost", "draining", "expected"),
    [c[1:] for c in GATE_CASES],
    ids=[c[0] for c in GATE_CASES],
)
def test_closed_reason_precedence(
    data: GateData | None, now: float, lost: bool, draining: bool, expected: str | None
) -> None:
    assert closed_reason_at(data, now, lost, draining) == expected


GATES = st.builds(
    GateData,
    lease=st.none()
    | st.builds(
        AdmissionWindow, static=st.none() | TEXT, fence_at=st.none() | FLOAT, admit_after=FLOAT
    ),
    monitor=st.none() | TEXT,
    valid_until=FLOAT,
)


@given(GATES)
def test_gate_data_json_round_trip(data: GateData) -> None:
    assert GateData.from_json(data.to_json()) == data
    assert GateData.from_json(orjson.loads(orjson.dumps(data.to_json()))) == data


P, D = Role.PREFILL, Role.DECODE
READY_CASES = [
    ("no-data", None, False, False, [P], [D], CONTROL_LOST),
    ("lost", gate(), True, False, [], [], CONTROL_LOST),
    ("draining", gate(OPEN, MONITOR), False, True, [P], [D], DRAINING),
    ("lease-before-draining", gate(AdmissionWindow("standby: x", None, 0.0), MONITOR), False,
     True, [P], [D], "standby: x"),
    ("lease-first", gate(AdmissionWindow("standby: x", None, 0.0), MONITOR), False, False, [P],
     [D], "standby: x"),
    ("monitor-next", gate(OPEN, MONITOR), False, False, [P], [D], MONITOR),
    ("starting-before-capacity", gate(OPEN), False, False, [P], [D], starting_reason(D)),
    ("capacity", gate(OPEN), False, False, [D, P], [], "no capacity: prefill"),
    ("ready", gate(OPEN), False, False, [], [], None),
]  # fmt: skip


@pytest.mark.parametrize(
    ("data", "lost", "draining", "without_capacity", "unverified", "expected"),
    [c[1:] for c in READY_CASES],
    ids=[c[0] for c in READY_CASES],
)
def test_worker_gate_ready(
    data: GateData | None,
    lost: bool,
    draining: bool,
    without_capacity: list[Role],
    unverified: list[Role],
    expected: str | None,
) -> None:
    worker = WorkerGate(FakeClock(monotonic=100.0))
    worker.data, worker.lost, worker.draining = data, lost, draining
    assert worker.ready(_fleet_where(without_capacity, unverified)) == expected


def _fleet_where(without_capacity: list[Role], unverified: list[Role]) -> Fleet:
    """p0 and d0: a role's engine unverified, or verified and ejected (no capacity), or in
    service."""
    clock = FakeClock(monotonic=100.0)
    fleet = Fleet(parse_config(BASE).engines[:2], clock)
    for engine in list(fleet):
        if engine.role not in unverified:
            fleet.apply(VerificationSeen(engine.id, True, "test"), 0.0)
        if engine.role in without_capacity and engine.role not in unverified:
            fleet.apply(EjectRequested(engine.id, "connection", "test"), 0.0)
    return fleet


def test_worker_gate_follows_its_clock() -> None:
    clock = FakeClock(monotonic=95.0)
    worker = WorkerGate(clock)
    worker.data = gate(OPEN)
    assert worker.closed_reason() is None
    assert worker.ready(_fleet_where([], [])) is None
    clock.advance(15.0)  # 110: the lease's local expiry, with no word from the control process
    assert worker.closed_reason() == FENCED_LINE
    assert worker.ready(_fleet_where([], [])) == FENCED_LINE
    clock.advance(10.0)  # 120: the control process's last word runs out; the lease stays lost
    assert worker.closed_reason() == FENCED_LINE
    worker.data = gate(AdmissionWindow(None, 130.0, 90.0))  # a lease still valid at 120
    assert worker.closed_reason() == CONTROL_LOST
    assert worker.ready(_fleet_where([], [])) == CONTROL_LOST


# --------------------------------------------------------------------------- supervisor helpers
def test_restart_delay_backs_off_then_caps() -> None:
    assert [restart_delay_s(n) for n in range(9)] == [0.0, 0.0, 0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    delays = [restart_delay_s(n) for n in range(200)]
    assert delays == sorted(delays)
    assert max(delays) == 10.0


def test_restart_delay_of_a_long_crash_loop_stays_capped() -> None:
    assert restart_delay_s(2000) == 10.0


@given(st.integers(min_value=0, max_value=100_000), st.integers(min_value=1, max_value=64))
def test_shares_split_evenly_remainder_first(total: int, n: int) -> None:
    split = shares(total, n)
    assert len(split) == n
    assert sum(split) == total
    assert max(split) - min(split) <= 1
    assert split == sorted(split, reverse=True)  # the remainder goes to the low indexes


def test_shares_examples() -> None:
    assert shares(10, 3) == [4, 3, 3]
    assert shares(2, 4) == [1, 1, 0, 0]
    assert shares(256, 1) == [256]


@pytest.mark.parametrize(("interval", "window"), [(0.1, 2.0), (0.5, 2.0), (2.5, 2.5), (3, 3)])
def test_control_window_is_the_monitor_interval_at_least_two_seconds(
    interval: float, window: float
) -> None:
    cfg = parse_config({**BASE, "controller": {"monitor_interval_s": interval}})
    assert control_window_s(cfg) == window


def _unused_pid() -> int:
    """A pid no process can have: pids are below the kernel's `pid_max`."""
    return int(Path("/proc/sys/kernel/pid_max").read_text())


def test_sweep_removes_dead_runtime_dirs_only(tmp_path: Path) -> None:
    dead = tmp_path / f"narwhal-{_unused_pid()}-abc"
    (dead / "metrics").mkdir(parents=True)
    (dead / "metrics" / "counter.db").write_bytes(b"x")
    alive = tmp_path / f"narwhal-{os.getpid()}-def"
    alive.mkdir()
    others = [tmp_path / "narwhal-notapid-x", tmp_path / "narwhal", tmp_path / "other-1-x"]
    for path in others:
        path.mkdir()
    assert sweep_stale_runtime_dirs(tmp_path) == [dead]
    assert not dead.exists()
    assert alive.is_dir()
    assert all(p.is_dir() for p in others)
    assert sweep_stale_runtime_dirs(tmp_path) == []


def test_sweep_ignores_a_pid_too_large_for_the_kernel(tmp_path: Path) -> None:
    """No process of ours has such a pid: not ours to remove, and no crash at start."""
    (tmp_path / f"narwhal-{2**31}-x").mkdir()
    assert sweep_stale_runtime_dirs(tmp_path) == []
    assert (tmp_path / f"narwhal-{2**31}-x").is_dir()


# --------------------------------------------------------------------------- serving.workers
def test_workers_default_to_the_usable_cpus() -> None:
    cfg = config()
    assert cfg.serving.workers == "auto"
    assert cfg.resolved_workers(usable_cpus=16) == 16


@pytest.mark.parametrize(
    ("workers", "max_connections", "cpus", "expected"),
    [
        ("auto", 256, 6, 6),
        ("auto", 4, 16, 4),  # capped by max_connections
        ("auto", 256, 0, 1),
        (3, 256, 16, 3),  # an explicit count is taken as it is
        (4, 4, 1, 4),
    ],
)
def test_resolved_workers(
    workers: int | str, max_connections: int, cpus: int, expected: int
) -> None:
    cfg = config(workers=workers, max_connections=max_connections)
    assert cfg.resolved_workers(usable_cpus=cpus) == expected


def test_auto_workers_default_to_the_usable_cpus() -> None:
    assert config(workers="auto").resolved_workers() == min(len(os.sched_getaffinity(0)), 256)


def test_llamacpp_runs_one_worker() -> None:
    assert config(api="llamacpp", workers="auto").resolved_workers(usable_cpus=8) == 1
    assert config(api="llamacpp", workers=1).resolved_workers(usable_cpus=8) == 1


@pytest.mark.parametrize(
    ("api", "serving"),
    [
        ("llamacpp", {"workers": 2}),
        ("vllm", {"workers": 5, "max_connections": 4}),
    ],
    ids=["llamacpp-several", "over-max-connections"],
)
def test_workers_config_errors_name_the_key(api: str, serving: dict[str, Any]) -> None:
    engines = [{**e, "api": api} for e in BASE["engines"]]
    problems = problems_of({**BASE, "engines": engines, "serving": serving})
    assert [p.split(": ", 1)[0] for p in problems] == ["serving.workers"], problems


@pytest.mark.parametrize("workers", [0, -2, "many", 1.5, None])
def test_bad_workers_values_are_refused_under_the_key(workers: object) -> None:
    problems = problems_of({**BASE, "serving": {"workers": workers}})
    assert problems
    assert all(p.startswith("serving.workers") for p in problems), problems


def test_a_bad_workers_value_is_one_problem_naming_exactly_the_key() -> None:
    problems = problems_of({**BASE, "serving": {"workers": 0}})
    assert [p.split(": ", 1)[0] for p in problems] == ["serving.workers"], problems


# --------------------------------------------------------------------------- shipped stats
SECONDS = st.floats(min_value=0.0, max_value=500.0, allow_nan=False)
SAMPLES = st.lists(st.tuples(st.sampled_from(IDS), SECONDS, SECONDS), max_size=60)


def _over_json(value: Any) -> Any:
    return orjson.loads(orjson.dumps(value))


@settings(deadline=None)
@given(SAMPLES, SAMPLES, st.lists(st.integers(min_value=0, max_value=60), max_size=4))
def test_shipped_interval_counts_equal_direct_observation(
    own: list[tuple[str, float, float]],
    worker_samples: list[tuple[str, float, float]],
    cuts: list[int],
) -> None:
    direct, control = IntervalStats(30.0, 0.0), IntervalStats(30.0, 0.0)
    worker = IntervalStats(float("inf"), 0.0)  # a worker never rolls over: it only ships

    def observe(stats: IntervalStats, engine_id: str, latency: float, gap: float) -> None:
        stats.request(engine_id)
        stats.latency(engine_id, latency)
        stats.inter_token(engine_id, gap)

    for sample in own:
        observe(direct, *sample)
        observe(control, *sample)

    def ship(now: float) -> None:
        window = worker.take(now)
        frame = {
            e: [w.requests, w.latency.sparse(), w.inter_token.sparse()]
            for e, w in window.engines.items()
        }
        for engine_id, (requests, latency, gap) in _over_json(frame).items():
            control.merge(engine_id, requests, latency, gap)

    cut_points = set(cuts)
    for i, sample in enumerate(worker_samples):
        if i in cut_points:
            ship(float(i))
        observe(direct, *sample)
        observe(worker, *sample)
    ship(99.0)

    assert worker.current.engines == {}
    assert worker.current.started == 99.0
    assert set(control.current.engines) == set(direct.current.engines)
    for engine_id, want in direct.current.engines.items():
        got = control.current.engines[engine_id]
        assert got.requests == want.requests
        assert got.latency == want.latency
        assert got.inter_token == want.inter_token
        assert got.to_json() == want.to_json()


@settings(deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from(["ok", "timeout", "bad_request", "upstream"]), SECONDS)),
    st.integers(min_value=0, max_value=50),
)
def test_shipped_timeline_counts_equal_direct_observation(
    requests: list[tuple[str, float]], cut: int
) -> None:
    direct, control, worker = Timeline(), Timeline(), Timeline()
    for i, (outcome, latency) in enumerate(requests):
        if i == cut:
            control.merge(*_over_json(worker.take()))
        direct.request(outcome, latency)
        worker.request(outcome, latency)
    control.merge(*_over_json(worker.take()))
    assert worker.take() == (0, 0, [])
    direct.sample(5.0)
    control.sample(5.0)
    assert control.samples == direct.samples


def test_histogram_sparse_lists_only_the_nonzero_buckets() -> None:
    h = Histogram()
    for seconds in (0.00005, 0.01, 0.01, 1e6):
        h.observe(seconds)
    sparse = h.sparse()
    assert [n for _, n in sparse] == [1, 2, 1]
    assert [i for i, _ in sparse] == sorted(i for i, _ in sparse)
    assert sparse[0][0] == 0 and sparse[-1][0] == len(h.counts) - 1
    merged = Histogram()
    merged.merge(sparse)
    assert merged == h
    assert Histogram().sparse() == []


# --------------------------------------------------------------------------- metrics
def _names(registry: Any) -> set[str]:
    return {family.name for family in registry.collect()}


def test_data_and_control_metrics_are_disjoint() -> None:
    metrics = Metrics()
    metrics.add_worker_metrics()
    data, control = _names(metrics.data.registry), _names(metrics.registry)
    assert {"narwhal_requests", "narwhal_retries", "narwhal_leg_outcomes"} <= data
    assert {"narwhal_engine_failures", "narwhal_worker_restarts"} <= control
    assert data.isdisjoint(control), data & control


def _types(text: str) -> set[str]:
    """The metric families a Prometheus page declares (`# TYPE name kind`)."""
    return {
        line.split()[2].removesuffix("_total")
        for line in text.splitlines()
        if line.startswith("# TYPE ")
    }


def test_render_has_both_parts() -> None:
    metrics = Metrics()
    declared = _types(metrics.render().decode())
    assert {"narwhal_requests", "narwhal_engine_failures"} <= declared
    assert _names(metrics.data.registry) | _names(metrics.registry) <= declared


def test_metrics_share_a_given_data_registry_and_render_it_as_told() -> None:
    data = DataMetrics()
    metrics = Metrics(data)
    assert metrics.requests is data.requests
    assert metrics.loop_lag is data.loop_lag
    metrics.render_data = lambda: b"# the workers' part\n"
    text = metrics.render().decode()
    assert text.endswith("# the workers' part\n")
    assert "narwhal_requests" not in _types(text)
    assert "narwhal_engine_failures" in _types(text)
