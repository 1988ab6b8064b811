"""One engine stream relayed to the client, as a state machine with no I/O inside.

The streaming leg (`stream_leg.py`) reads the engine and writes the client; this machine is
fed what happened (engine bytes, bytes sent, the body's end, a timer, a move, a client that
left) and says what to send and how the stream ends:

    waiting ──first bytes sent──▶ relaying ──[DONE]──▶ done
       │ (and waiting ──[DONE]──▶ done)  │
       └───────────────┬─────────────────┘
                       ▼
       failed | client_gone | moved | deadline

`failed` carries the engine's fault (no `[DONE]`, a malformed event, an in-band error event,
a late first byte, mid-stream silence); `deadline` is the request's own clock (the engine was
making progress, or the client stopped reading); `moved` is the operator's planned maintenance.
Whether a failure is continued elsewhere (migration) is the policy's, not this machine's.
Per chunk it costs what the bytes path did before (the SSE scanner and, for a stream that may
migrate, the splice's rewrite); transitions happen a few times per stream.
"""

from __future__ import annotations

import logging
from enum import Enum, StrEnum

from narwhal.dataplane.migration import Splice
from narwhal.dataplane.sse import SseScanner

log = logging.getLogger("narwhal.relay")


class Phase(StrEnum):  # a str: hashed and logged in C
    WAITING = "waiting"  # no byte reached the client yet
    RELAYING = "relaying"
    DONE = "done"  # `[DONE]` reached the client
    FAILED = "failed"  # the engine's fault: `failure` says which
    CLIENT_GONE = "client_gone"
    MOVED = "moved"  # planned maintenance moved the stream off its engine
    DEADLINE = "deadline"  # the request's own deadline ran out


TRANSITIONS: dict[Phase, frozenset[Phase]] = {
    # `[DONE]` may end a stream whose events the splice held back: waiting -> done.
    Phase.WAITING: frozenset(
        {Phase.RELAYING, Phase.DONE, Phase.FAILED, Phase.CLIENT_GONE, Phase.MOVED, Phase.DEADLINE}
    ),
    Phase.RELAYING: frozenset(
        {Phase.DONE, Phase.FAILED, Phase.CLIENT_GONE, Phase.MOVED, Phase.DEADLINE}
    ),
    Phase.DONE: frozenset(),
    Phase.FAILED: frozenset(),
    Phase.CLIENT_GONE: frozenset(),
    Phase.MOVED: frozenset(),
    Phase.DEADLINE: frozenset(),
}


_GOING = frozenset({Phase.WAITING, Phase.RELAYING, Phase.DONE})


class IllegalTransition(Exception):
    pass


class Failure(Enum):
    """How the engine failed a stream (all `stream` class but the in-band error)."""

    NO_DONE = "stream ended without [DONE]"
    MALFORMED = "malformed SSE event"
    ERROR_EVENT = "error event"  # in band (then `[DONE]`): inference_status
    FIRST_TOKEN = "first-token deadline"
    SILENCE = "mid-stream silence"

    @property
    def timed_out(self) -> bool:
        return self in (Failure.FIRST_TOKEN, Failure.SILENCE)


class Relay:
    __slots__ = ("_splice", "failure", "phase", "scanner", "started", "write_timed_out")

    def __init__(self, splice: Splice | None) -> None:
        self._splice = splice
        self.scanner = SseScanner()
        self.phase = Phase.WAITING
        self.failure: Failure | None = None
        self.started = False  # the client has bytes of this stream
        self.write_timed_out = False  # the deadline passed while the client was not reading

    def _to(self, phase: Phase, reason: str) -> None:
        """The one transition function."""
        if phase not in TRANSITIONS[self.phase]:
            raise IllegalTransition(f"relay {self.phase.value} -> {phase.value} ({reason})")
        log.debug("relay %s -> %s (%s)", self.phase, phase, reason)
        self.phase = phase

    def feed(self, chunk: bytes) -> bytes:
        """The engine's next bytes (b"" at the body's end); returns what to send the client.
        Afterwards `phase` is `failed` when the stream cannot go on before anything is sent."""
        scanner = self.scanner
        if chunk:
            scanner.feed(chunk)
        else:
            # A final `data: [DONE]` line without its blank line is done: the client gets the
            # bytes that complete the event.
            chunk = scanner.end()
            if not chunk:
                return b""
        if self._splice is not None:
            # Whole events, rewritten, up to a malformed one: the client has every good token
            # before it (then the stream goes on elsewhere).
            return self._splice.relay(chunk)
        if scanner.malformed:
            self._fail(Failure.MALFORMED)
            return b""
        return chunk

    def sent(self) -> bool:
        """Bytes reached the client; True for the stream's first."""
        if self.started:
            return False
        self.started = True
        self._to(Phase.RELAYING, "first bytes sent")
        return True

    def settle(self) -> bool:
        """After a chunk: whether the stream stops here (`phase` says how)."""
        splice = self._splice
        if splice is not None and (self.scanner.malformed or splice.broken):
            self._fail(Failure.MALFORMED)
            return True
        return self.scanner.done

    @property
    def complete(self) -> bool:
        """`[DONE]` arrived and the client was sent every byte it should (the engine's
        connection may then be kept)."""
        return (
            self.phase in _GOING
            and self.scanner.done
            and (self._splice is None or self._splice.done)
        )

    def ended(self) -> None:
        """The engine's body ended (or `[DONE]` arrived): judge the stream as a whole."""
        scanner = self.scanner
        if not scanner.done:
            self._fail(Failure.NO_DONE)
        elif scanner.error is not None:
            self._fail(Failure.ERROR_EVENT)
        else:
            self._to(Phase.DONE, "[DONE]")

    def timed_out(self, writing: bool, at_request_deadline: bool) -> None:
        """The stream's timer expired: while the router was `writing` to the client (the
        client stopped reading), at the request's own deadline, or on the engine's clock."""
        if writing:
            self.write_timed_out = True
            self._to(Phase.DEADLINE, "the client stopped reading")
        elif at_request_deadline and self.started:
            self._to(Phase.DEADLINE, "request deadline")
        else:
            self._fail(Failure.SILENCE if self.started else Failure.FIRST_TOKEN)

    def moved(self) -> None:
        self._to(Phase.MOVED, "planned maintenance")

    def client_gone(self) -> None:
        self._to(Phase.CLIENT_GONE, "client disconnected")

    def _fail(self, failure: Failure) -> None:
        self.failure = failure
        self._to(Phase.FAILED, failure.value)
