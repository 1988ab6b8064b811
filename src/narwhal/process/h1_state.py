"""One client connection of the HTTP/1.1 server as an I/O-free state machine (as h11 does it).

Two sides, each with its states and its transition table: what the client sends (`In`: idle
between requests, reading a head, reading a body, discarding what is left of a body, closed)
and what the server does (`Out`: idle, waiting for a handler, streaming an answer, closed).
The shell (`h1_server.py`) feeds it the parser's events and the time, and does what it says:
refuse a request (`Refusal`: the status, and the reason counted in
`narwhal_client_rejected_total`), close, keep the connection for the next request. A pair
(state, event) missing from a table is a bug in the shell (`ProtocolError`), never the
client's doing.

Every limit of DESIGN §12 is decided here, before any work for the request is done:
- the whole head within `header_timeout_s` (from the accept, or from the first byte of a
  next request) and `max_head_bytes` (431);
- a declared body over `max_body_bytes` (413) as soon as the head is in, so before the key is
  checked and before `100 Continue`; a body of any framing past it as it arrives (413);
- at most `body_timeout_s` between two reads of a body (408), counted only while the server
  is reading: not before a `100 Continue` the client waits for, nor while the server itself
  paused reading (a full buffer);
- an idle keep-alive connection closes after `keepalive_s`; what is left of a body after an
  early answer is dropped for at most `linger_s`; past `max_body_bytes` of it reading stops
  (`discard_full`: a close on a client still sending could reset away its answer), and the
  connection closes at the linger's end.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class In(StrEnum):
    IDLE = "idle"  # between requests: nothing of the next one yet
    HEAD = "reading_head"  # a head is arriving (a new connection starts here)
    BODY = "reading_body"  # the head is in; the body arrives (possibly empty)
    DISCARD = "discarding"  # answered before the body was in: the rest is dropped
    CLOSED = "closed"


class Out(StrEnum):
    IDLE = "idle"  # no handler runs
    HANDLER = "waiting_for_handler"  # a handler runs, nothing of its answer written
    STREAMING = "streaming"  # the answer's head went out, its chunks follow
    CLOSED = "closed"


class Event(StrEnum):
    DATA = "data"  # bytes arrived
    BEGIN = "begin"  # the parser starts a request
    HEAD = "head"  # the parser has the whole head
    BODY = "body"  # a piece of body
    END = "end"  # the parser has the whole request
    START = "start"  # a handler starts on the oldest complete head
    STREAM = "stream"  # the handler sent a stream's head
    ANSWERED = "answered"  # the handler's answer is out, whole
    EARLY = "early"  # answered while the request's body still arrives
    REFUSE = "refuse"  # a limit, or a malformed request: answer (if possible) and close
    CLOSE = "close"  # the server closes (idle, drain, after an answer that said close)
    LOST = "lost"  # the client disconnected


IN_TABLE: dict[tuple[In, Event], In] = {
    (In.IDLE, Event.DATA): In.HEAD,
    (In.HEAD, Event.DATA): In.HEAD,
    (In.IDLE, Event.BEGIN): In.HEAD,
    (In.HEAD, Event.BEGIN): In.HEAD,
    (In.HEAD, Event.HEAD): In.BODY,
    (In.BODY, Event.DATA): In.BODY,
    (In.BODY, Event.BODY): In.BODY,
    (In.BODY, Event.END): In.IDLE,
    (In.BODY, Event.EARLY): In.DISCARD,
    (In.DISCARD, Event.DATA): In.DISCARD,
    (In.DISCARD, Event.BODY): In.DISCARD,
    (In.DISCARD, Event.END): In.CLOSED,
    # A refused request's answer is followed by a half-close; what the client still sends
    # is dropped for a moment, so that it reads the answer instead of a reset.
    **{(s, Event.REFUSE): In.DISCARD for s in In if s is not In.CLOSED},
    (In.CLOSED, Event.REFUSE): In.CLOSED,
    **{(s, Event.CLOSE): In.CLOSED for s in In},
    **{(s, Event.LOST): In.CLOSED for s in In},
}

OUT_TABLE: dict[tuple[Out, Event], Out] = {
    (Out.IDLE, Event.START): Out.HANDLER,
    (Out.HANDLER, Event.STREAM): Out.STREAMING,
    (Out.HANDLER, Event.ANSWERED): Out.IDLE,
    (Out.STREAMING, Event.ANSWERED): Out.IDLE,
    # A refusal while a handler runs reaches it (its next read raises); it still answers.
    (Out.IDLE, Event.REFUSE): Out.CLOSED,
    (Out.HANDLER, Event.REFUSE): Out.HANDLER,
    (Out.STREAMING, Event.REFUSE): Out.STREAMING,
    (Out.CLOSED, Event.REFUSE): Out.CLOSED,
    **{(s, Event.CLOSE): Out.CLOSED for s in Out},
    **{(s, Event.LOST): Out.CLOSED for s in Out},
}


# How long a refused connection's remaining input is dropped before the close.
REFUSAL_LINGER_S = 2.0


class ProtocolError(Exception):
    """An event the tables do not allow in the current state: the shell's bug."""


MAX_HEAD_BYTES = 64 * 1024
KEEPALIVE_S = 75.0  # aiohttp's default keepalive_timeout
LINGER_S = 10.0  # aiohttp's lingering_time


@dataclass(frozen=True, slots=True)
class Limits:
    """Defaults as `serving` has them (DESIGN §12)."""

    max_head_bytes: int = MAX_HEAD_BYTES
    max_body_bytes: int = 4 * 1024 * 1024
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    # the shell's: how long the client's socket may stay full with nothing taken from it
    send_timeout_s: float = 60.0
    keepalive_s: float = KEEPALIVE_S
    linger_s: float = LINGER_S


@dataclass(frozen=True, slots=True)
class Refusal:
    """A request refused: its status, the metric's reason, and the message."""

    status: int
    reason: str
    message: str


class After(StrEnum):
    """What follows a whole answer."""

    KEEP = "keep"  # serve the next request, or wait for it
    DISCARD = "discard"  # drop the rest of the body, then close
    CLOSE = "close"


class Connection:
    """The state of one connection; every method takes `now` (monotonic seconds)."""

    def __init__(self, limits: Limits, now: float) -> None:
        self.limits = limits
        self.inbound = In.HEAD  # the first head's clock runs from the accept
        # Read on every event by the shell: kept as attributes by `_in`, not properties.
        self.closed = False
        self.discarding = False
        self.closing = False  # no further request will be read on this connection
        self.discard_full = False  # the drop allowance is used up: read nothing more
        self.outbound = Out.IDLE
        self._since = now  # when the current timed phase began
        self._last_read = now
        self._head_raw = 0  # bytes received while the head is incomplete
        self._head_parsed = 0  # the head's bytes as the parser handed them over
        self._body_bytes = 0
        self._discarded = 0
        self.expects_continue = False
        self.continue_sent = False
        self.paused = False  # the server paused reading (its buffers are full)
        self._heard = False  # a byte of a request arrived on this connection
        self._linger_s = limits.linger_s

    # ---------------------------------------------------------------- transitions
    def _in(self, event: Event) -> None:
        try:
            inbound = self.inbound = IN_TABLE[self.inbound, event]
        except KeyError:
            raise ProtocolError(f"inbound {self.inbound}: {event}") from None
        self.closed = inbound is In.CLOSED
        self.discarding = inbound is In.DISCARD
        self.closing = self.closed or self.discarding

    def _out(self, event: Event) -> None:
        try:
            self.outbound = OUT_TABLE[self.outbound, event]
        except KeyError:
            raise ProtocolError(f"outbound {self.outbound}: {event}") from None

    @property
    def answer_pending(self) -> bool:
        """Refused while its handler runs: nothing more is read until it has answered (the
        rest of the body, dropped meanwhile, would use up the linger before the answer)."""
        return self.inbound is In.DISCARD and self.outbound in (Out.HANDLER, Out.STREAMING)

    def data(self, size: int, now: float) -> None:
        """Bytes arrived (before the parser sees them)."""
        if self.closed:
            return
        if self.inbound is In.IDLE:
            self._begin(now)
        self._in(Event.DATA)
        if self.inbound is In.HEAD:
            self._head_raw += size
            self._heard = True
        elif self.inbound is In.DISCARD and not self.answer_pending:
            self._discarded += size
            # Enough dropped: the shell stops reading until the linger ends (then closes).
            # Closing now, on a client still sending, would reset the connection, and a
            # reset can destroy the answer in the client's buffer before it is read.
            self.discard_full = self._discarded > self.limits.max_body_bytes

    def parsed(self, now: float) -> Refusal | None:
        """The parser took the bytes: a head still incomplete over `max_head_bytes` is
        refused on its raw size (the parser hands a header over only once its line ends, so
        a line that never ends would otherwise be buffered)."""
        if self.inbound is In.HEAD and self._head_raw > self.limits.max_head_bytes:
            return self.refuse(431, "header_too_large", "request head too large", now)
        return None

    def begin(self, now: float) -> None:
        """The parser starts a request (maybe in the bytes that ended the last one)."""
        if self.inbound is In.IDLE:
            self._begin(now)
        self._in(Event.BEGIN)
        self._head_parsed = 0

    def _begin(self, now: float) -> None:
        self._since = now
        self._head_raw = 0

    def header(self, size: int, now: float) -> Refusal | None:
        """A piece of the head, as the parser hands it over (the target, a header)."""
        self._head_parsed += size
        if self._head_parsed > self.limits.max_head_bytes:
            return self.refuse(431, "header_too_large", "request head too large", now)
        return None

    def head(
        self, content_length: int | None, expects_continue: bool, now: float
    ) -> Refusal | None:
        """The whole head is in: the declared size is checked before anything else."""
        self._in(Event.HEAD)
        self._head_raw = 0
        self._body_bytes = 0
        self._last_read = now
        self.expects_continue = expects_continue
        self.continue_sent = False
        limit = self.limits.max_body_bytes
        if content_length is not None and content_length > limit:
            return self.refuse(413, "body_too_large", f"request body exceeds {limit} bytes", now)
        return None

    def body(self, size: int, now: float) -> Refusal | None:
        """A piece of body arrived."""
        self._in(Event.BODY)
        if self.inbound is In.DISCARD:
            return None
        self._last_read = now
        self._body_bytes += size
        limit = self.limits.max_body_bytes
        if self._body_bytes > limit:
            return self.refuse(413, "body_too_large", f"request body exceeds {limit} bytes", now)
        return None

    def end(self, now: float) -> None:
        """The whole request is in."""
        self._in(Event.END)
        self._since = now

    def start(self) -> None:
        self._out(Event.START)

    def want_body(self, now: float) -> bool:
        """The handler asks for the body: True when `100 Continue` must go out now (the key
        and the declared size were accepted, since the handler runs and reads)."""
        if self.expects_continue and not self.continue_sent and self.inbound is In.BODY:
            self.continue_sent = True
            self._last_read = now  # the client starts sending now
            return True
        return False

    def pause(self, paused: bool, now: float) -> None:
        """The server paused (or resumed) reading: the body's clock stops meanwhile."""
        self.paused = paused
        if not paused:
            self._last_read = now

    def stream(self) -> None:
        self._out(Event.STREAM)

    def answered(self, complete: bool, keep_alive: bool, now: float) -> After:
        """The handler's answer is out, whole. `complete`: its request's body had all
        arrived; `keep_alive`: the head said the connection stays (it does not while
        draining, nor after a body that did not all arrive)."""
        self._out(Event.ANSWERED)
        if self.closed:
            return After.CLOSE
        if self.inbound is In.DISCARD:  # refused while the handler ran: it answered that
            self._since = now  # the linger starts with the answer
            self._discarded = 0
            return After.DISCARD
        if complete:
            if not keep_alive:
                self.close()
                return After.CLOSE
            self._since = now
            return After.KEEP
        if self.expects_continue and not self.continue_sent:
            self.close()  # the client waits for a go that never comes
            return After.CLOSE
        self._in(Event.EARLY)
        self._since = now
        self._linger_s = self.limits.linger_s
        self._discarded = 0
        return After.DISCARD

    def refuse(self, status: int, reason: str, message: str, now: float) -> Refusal:
        if self.inbound is not In.DISCARD:
            self._since = now
            self._linger_s = min(self.limits.linger_s, REFUSAL_LINGER_S)
            self._discarded = 0
        self._in(Event.REFUSE)
        self._out(Event.REFUSE)
        return Refusal(status, reason, message)

    def close(self) -> None:
        self._in(Event.CLOSE)
        self._out(Event.CLOSE)

    def lost(self) -> None:
        self._in(Event.LOST)
        self._out(Event.LOST)

    # ---------------------------------------------------------------- time
    def deadline(self) -> float | None:
        """When `expire` has something to do, if nothing else happens first."""
        limits, inbound = self.limits, self.inbound
        if inbound is In.HEAD:
            return self._since + limits.header_timeout_s
        if inbound is In.BODY:
            waiting = self.expects_continue and not self.continue_sent
            if self.paused or waiting:
                return None
            return self._last_read + limits.body_timeout_s
        if inbound is In.DISCARD:
            if self.outbound is Out.HANDLER:
                return None  # a refused body's handler answers the refusal first
            return self._since + self._linger_s
        if inbound is In.IDLE and self.outbound is Out.IDLE:
            return self._since + limits.keepalive_s
        return None

    def expire(self, now: float) -> Refusal | None:
        """The timer fired: a 408 for a head or body too slow; an idle or lingering
        connection just closes (`closed` then says so)."""
        deadline = self.deadline()
        if deadline is None or now < deadline:
            return None
        if self.inbound is In.HEAD and not self._heard:
            self.close()  # a connection never used: closed as an idle one, no answer
            return None
        if self.inbound is In.HEAD:
            return self.refuse(408, "header_timeout", "request head not received in time", now)
        if self.inbound is In.BODY:
            return self.refuse(408, "body_timeout", "request body not received in time", now)
        self.close()
        return None
