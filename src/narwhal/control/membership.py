"""Engines joining and leaving while the router runs (DESIGN §10).

Sources change the membership: the operator (`POST /admin/engines`, `DELETE
/admin/engines/{id}`), a config reload, discovery (DNS, a file), and, on a standby, the
active's handoff. Each engine has an origin (`config`, `operator`, `dns`, `file`), and a
source adds, relocates and removes only engines of its own origin: a reload never removes an
engine the operator added, nor discovery one that the config lists. Each change is one of:

- **added**: the engine joins unverified, and takes work after its first healthy answer with
  the right model (the health stage verifies it, as at start);
- **removing**: it takes no new work at once and is never ejected or charged evidence for
  leaving (`Leaving`); the monitor's drains stage forgets it once its requests settled;
- **removed**: it is forgotten (at once with `force`, its requests finishing on their own);
- **relocated**: the same id at a new address, a new process to verify.

`plan` is the pure part: the changes that turn the current members into a desired set.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from narwhal.clock import Clock
from narwhal.config import EngineConfig, embed_mix_problem
from narwhal.fleet.events import Leaving, Relocated
from narwhal.fleet.store import Fleet
from narwhal.telemetry.metrics import Metrics

log = logging.getLogger("narwhal.membership")


ORIGINS = {"reload": "config"}
"""A source's origin where the names differ: a reload manages the config's engines."""


class MembershipConflict(Exception):
    """A change that cannot be made as asked (a duplicate id or url, another engine API)."""


@dataclass(frozen=True)
class Plan:
    """What turns the members into the desired set: engines to add, to remove (drained),
    and to relocate; a role or API change is a removal and an addition."""

    add: tuple[EngineConfig, ...] = ()
    remove: tuple[str, ...] = ()
    relocate: tuple[EngineConfig, ...] = ()
    replace: tuple[EngineConfig, ...] = ()  # removed at once, then added anew

    @property
    def empty(self) -> bool:
        return not (self.add or self.remove or self.relocate or self.replace)

    def to_json(self) -> dict[str, list[str]]:
        return {
            "added": [e.id for e in self.add],
            "removed": list(self.remove),
            "relocated": [e.id for e in self.relocate],
            "replaced": [e.id for e in self.replace],
        }


def plan(current: Iterable[EngineConfig], desired: Sequence[EngineConfig]) -> Plan:
    """The changes from `current` (the members not already leaving) to `desired`."""
    have = {e.id: e for e in current}
    want = {e.id: e for e in desired}
    add, relocate, replace = [], [], []
    for engine_id, config in want.items():
        old = have.get(engine_id)
        if old is None:
            add.append(config)
        elif old == config:
            continue
        elif _same_engine(old, config):
            relocate.append(config)
        else:
            replace.append(config)
    remove = tuple(sorted(set(have) - set(want)))
    return Plan(tuple(add), remove, tuple(relocate), tuple(replace))


def _same_engine(old: EngineConfig, new: EngineConfig) -> bool:
    """Only where it is served (and how it is reached) changed: a relocation."""
    return (old.role, old.kv_role, old.api, old.model) == (
        new.role,
        new.kv_role,
        new.api,
        new.model,
    )


@dataclass
class Membership:
    """Applies membership changes to the fleet, with logs and metrics; `publish` pushes them
    to the data-plane workers, `forgotten` tells the rest of the control plane."""

    fleet: Fleet
    metrics: Metrics
    clock: Clock
    api: str  # the fleet's one engine API
    model: str  # what an engine that names no model must serve (the config's `model`)
    publish: Callable[[], None]
    forgotten: list[Callable[[str], None]] = field(default_factory=list)
    _removed_by: dict[str, str] = field(default_factory=dict)  # leaving engines' sources

    def members(self, origin: str | None = None) -> list[EngineConfig]:
        """The engines that stay (not leaving), of `origin` (None: every origin)."""
        return [
            e.config
            for e in self.fleet
            if e.leaving is None and (origin is None or e.origin == origin)
        ]

    def check(self, config: EngineConfig) -> None:
        """Refuse an engine that cannot join as it is (MembershipConflict says why)."""
        if self.fleet.has(config.id):
            state = self.fleet.get(config.id)
            what = "is leaving; wait until it is gone" if state.leaving else "exists"
            raise MembershipConflict(f"engine {config.id!r} {what}")
        for engine in self.fleet:
            if engine.config.url == config.url:
                raise MembershipConflict(f"url {config.url} is engine {engine.id!r}'s")
        if config.api != self.api:
            raise MembershipConflict(
                f"api: {config.api} differs from the fleet's {self.api}; a fleet speaks one "
                "engine API"
            )
        members = [e.config for e in self.fleet if e.leaving is None]
        problem = embed_mix_problem([*members, config])
        if problem is not None:
            raise MembershipConflict(problem.split(": ", 1)[1])

    def add(self, config: EngineConfig, source: str, origin: str | None = None) -> None:
        """Add an engine; its origin is `source`'s (`reload`: `config`) unless given."""
        config = config.with_model(self.model)
        self.check(config)
        try:
            self.fleet.add(config, f"added by {source}", origin or ORIGINS.get(source, source))
        except ValueError as exc:  # the workers' table is full
            raise MembershipConflict(str(exc)) from None
        self._count("added", source)
        self.publish()

    def remove(self, engine_id: str, source: str, force: bool = False) -> bool:
        """Drain the engine and forget it once its requests settle (True when it is already
        gone: nothing in flight, or `force`)."""
        engine = self.fleet.get(engine_id)
        if engine.leaving is None:
            self.fleet.apply(Leaving(engine_id, f"removed by {source}"), self.clock.monotonic())
            self._removed_by[engine_id] = source
            self._count("removing", source)
        if force or self.fleet.in_flight.of(engine_id) == 0:
            self._forget(engine_id, "forced" if force else "nothing in flight", source)
            return True
        self.publish()
        return False

    def relocate(self, config: EngineConfig, source: str) -> None:
        self.fleet.apply(Relocated(config.id, config, f"by {source}"), self.clock.monotonic())
        self._count("relocated", source)
        self.publish()

    def apply(
        self,
        desired: Sequence[EngineConfig],
        source: str,
        origins: Mapping[str, str] | None = None,
    ) -> Plan:
        """Make `source`'s engines `desired` (a reload, a discovery round); checked first, so
        a conflict (an id or url listed twice, or another engine's) changes nothing.
        `origins` (a standby following the handoff): `desired` is the whole fleet, each
        engine with its origin."""
        origin = None if origins is not None else ORIGINS.get(source, source)
        desired = [c.with_model(self.model) for c in desired]
        for what, values in (("id", [c.id for c in desired]), ("url", [c.url for c in desired])):
            repeated = sorted(v for v, n in Counter(values).items() if n > 1)
            if repeated:  # one engine twice (a pod on two ports): neither wins by order
                raise MembershipConflict(f"engine {what} listed twice: {repeated} in one answer")
        change = plan(self.members(origin), desired)
        staying = {e.id for e in self.members(origin)} - set(change.remove)
        others = {e.id for e in self.fleet if origin is not None and e.origin != origin}
        urls = {e.config.url: e.id for e in self.fleet if e.id in staying or e.id in others}
        for config in (*change.add, *change.relocate, *change.replace):
            if config.id in others:
                raise MembershipConflict(f"engine {config.id!r} is another source's")
            owner = urls.get(config.url)
            if owner is not None and owner != config.id:
                raise MembershipConflict(f"url {config.url} is engine {owner!r}'s")
            if config.api != self.api:
                raise MembershipConflict(f"engines: {config.id}: api {config.api} differs")
        for config in change.add:
            leaving = self.fleet.has(config.id)  # removed earlier, requests still running
            if leaving:
                self._forget(config.id, "added again", source)
        for engine_id in change.remove:
            self.remove(engine_id, source)
        for config in change.replace:
            self._forget(config.id, "role or api changed", source)
        for config in (*change.add, *change.replace):
            self.add(config, source, None if origins is None else origins.get(config.id))
        for config in change.relocate:
            self.relocate(config, source)
        return change

    def settle(self) -> None:
        """Forget leaving engines whose requests have all settled (the drains stage)."""
        for engine in list(self.fleet):
            if engine.leaving is not None and self.fleet.in_flight.of(engine.id) == 0:
                source = self._removed_by.get(engine.id, "operator")
                self._forget(engine.id, "its requests settled", source)

    def _forget(self, engine_id: str, why: str, source: str) -> None:
        self._removed_by.pop(engine_id, None)
        self.fleet.forget(engine_id, f"removed: {why}")
        self._count("removed", source)
        for told in self.forgotten:
            told(engine_id)
        self.publish()

    def _count(self, change: str, source: str) -> None:
        self.metrics.membership_changes.labels(change, source).inc()
