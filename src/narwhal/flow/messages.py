"""Flow control's vocabulary (DESIGN §13): the events its step takes in (from the data planes,
the workers' supervisor and the control process) and the answers it sends out. Plain frozen
records, so the step stays pure and the worker channel can carry them (`process/events.py`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from narwhal.flow.reasons import ShedReason


# ---------------------------------------------------------------- events in
@dataclass(frozen=True, slots=True)
class Ask:
    """A request asks to start. `group` is its model; `client` whose fair share it is (the
    key's label, else the tenant header, else ""); `key` its rate-limit key (None: none);
    `tokens` what its start charges (prompt tokens, estimated when not counted);
    `rate_tokens` what the rate limit takes (prompt plus `max_tokens`); `wait_s` how long it
    may still wait; `queue` whether flow control orders it (else only its rate limit)."""

    id: str
    group: str
    client: str
    key: str | None
    priority: int
    tokens: int
    rate_tokens: int
    wait_s: float
    queue: bool = True
    worker: int = 0
    preemptible: bool = False  # a stream that may migrate: it can step aside and go on later


@dataclass(frozen=True, slots=True)
class Begun:
    """A granted request placed its leg of `role` (`prefill`, `decode` or `both`): the data
    plane's in-flight count has it from now on."""

    id: str
    role: str
    engine: str = ""  # the engine it was placed on


@dataclass(frozen=True, slots=True)
class Done:
    """A started request ended; `output_tokens` served (None: not known)."""

    id: str
    output_tokens: int | None = None
    prompt_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class Withdraw:
    """The client left (or its worker drains) before the request ended."""

    id: str


@dataclass(frozen=True, slots=True)
class Requeue:
    """A preempted request's leg left its engine: it waits for a new grant to go on."""

    id: str


@dataclass(frozen=True, slots=True)
class Kept:
    """A request asked to step aside could not: it runs on. `for_now`: not yet (between legs,
    or before its answer's first byte), so it may be asked again a little later; else (out of
    migrations, its generation delivered, not movable) it is not asked again."""

    id: str
    for_now: bool = False


@dataclass(frozen=True, slots=True)
class WorkerLost:
    """A worker exited: its requests are gone, waiting or running."""

    worker: int


@dataclass(frozen=True, slots=True)
class Tick:
    """Something outside changed (a scrape, the fleet, the clock): run the pass."""


@dataclass(frozen=True, slots=True)
class Fence:
    """This router no longer admits (the lease lost, the monitor closed admission): every
    waiting request is answered 503 now; the rate-limit buckets are dropped."""

    reason: str


@dataclass(frozen=True, slots=True)
class Resize:
    """A reload: the queue's new limit (what it sheds is answered)."""

    limit: int


FromDataPlane = Ask | Begun | Done | Withdraw | Requeue | Kept
"""What a data plane tells flow control about its requests."""
FlowEvent = FromDataPlane | WorkerLost | Tick | Fence | Resize


# ---------------------------------------------------------------- answers out
@dataclass(frozen=True, slots=True)
class Start:
    id: str
    worker: int
    priority: int
    waited_s: float
    headers: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Refuse:
    """Answer the request now: `status` (429 or 503), OpenAI's error `type` and `code`,
    `Retry-After` (None: none, e.g. a request larger than its key's whole limit), and the
    `x-ratelimit-*` headers. `reason` is a `ShedReason` value, or `not_admitted`."""

    id: str
    worker: int
    status: int
    reason: str
    message: str
    retry_after_s: int | None
    headers: Mapping[str, str]
    priority: int
    waited_s: float = 0.0
    key: str | None = None  # the client key's label, for the refusals counted by key

    @property
    def error_type(self) -> str:
        if self.status == 503:
            return "service_unavailable"
        return "tokens" if self.reason == ShedReason.TOKENS_PER_MINUTE else "requests"

    @property
    def code(self) -> str:
        return "not_admitted" if self.status == 503 else "rate_limit_exceeded"


@dataclass(frozen=True, slots=True)
class Preempt:
    """Ask a running stream (of `priority`) to step aside for a more urgent request."""

    id: str
    worker: int
    priority: int


FlowEffect = Start | Refuse | Preempt
