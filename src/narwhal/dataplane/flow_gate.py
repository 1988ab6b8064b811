"""The data plane's side of flow control (DESIGN §13, docs/flow.md): before a request is
served it asks the router's one queue (`flow/state.py`, in the control process) to start, and
waits for `start` or `refuse`. Then it tells the queue when each of its legs is placed (the
engines' in-flight counts have it from then on) and when it ends, with the tokens it used.

The same `FlowGate` runs in every process mode; only its `FlowLink` differs: with one process
it calls the control side directly, in a worker it sends frames over the channel. A request
asks only when flow control is on (`Config.flow_on`, generation only) or its key has rate
limits; with neither (the default) the data plane never calls it. With flow control on, the
body's `priority` is read (a wrong one is a 400) and removed before the body goes to an engine:
the router orders by it, and vLLM refuses a non-zero one unless it runs with
`--scheduling-policy priority`. With flow control off it goes to the engine as sent.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any, Protocol, TypeVar, cast

from narwhal.config import Config
from narwhal.dataplane.errors import error_answer
from narwhal.dataplane.exchange import Answer, Exchange, Result
from narwhal.dataplane.migration import migratable
from narwhal.dataplane.outcomes import DeadlineExceeded, NotResumed, bad_request
from narwhal.dataplane.policy import StepAside
from narwhal.dataplane.record import usage_tokens
from narwhal.dataplane.requests import BadRequest, ClientRequest, EmbeddingsRequest
from narwhal.fleet.inflight import Choose, InFlightCounts
from narwhal.flow.messages import (
    Ask,
    Begun,
    Done,
    FlowEffect,
    FromDataPlane,
    Kept,
    Preempt,
    Refuse,
    Requeue,
    Start,
    Withdraw,
)
from narwhal.flow.priority import PriorityError, resolve_priority
from narwhal.flow.ratelimit import Limits

TENANT_HEADER = "x-narwhal-tenant"
R = TypeVar("R", bound=Result | None)
CHARS_PER_TOKEN = 4  # a prompt's tokens, estimated from its text when not counted


class FlowLink(Protocol):
    """Where a data plane's flow events go: the control side, directly or over a channel."""

    def send(self, event: FromDataPlane) -> None: ...


class Ticket:
    """A request flow control started: its placements and its end go back."""

    __slots__ = ("_link", "_placed", "headers", "id")

    def __init__(self, request_id: str, link: FlowLink, headers: dict[str, str]) -> None:
        self.id = request_id
        self._link = link
        self._placed: dict[str, str] = {}  # role: the engine flow control was told
        self.headers = headers  # `x-ratelimit-*`, for the answer

    def placed_on(self, role: str, engine_id: str) -> None:
        """Told once per role and engine: a retry or a migration placed elsewhere is told
        too, so preemption judges the engine the stream is on now."""
        if self._placed.get(role) != engine_id:
            self._placed[role] = engine_id
            self._link.send(Begun(self.id, role, engine_id))

    def placed_anew(self) -> None:
        """Preempted: its next grant's legs are placed (and told) again."""
        self._placed.clear()

    def finish(self, result: R, usage_source: bytes | None) -> R:
        """Tell flow control the request ended (with its tokens, when known); an answer gets
        the key's `x-ratelimit-*` headers."""
        source = result.body if isinstance(result, Answer) and result.status == 200 else None
        prompt, output = usage_tokens(source or usage_source)
        self._link.send(Done(self.id, output, prompt))
        _TICKET.set(None)
        if isinstance(result, Answer) and self.headers:
            headers = {**self.headers, **(result.headers or {})}
            return cast(
                R, Answer(result.status, result.body, result.content_type, result.outcome, headers)
            )
        return result


_TICKET: ContextVar[Ticket | None] = ContextVar("narwhal_flow_ticket", default=None)


class TicketedInFlight:
    """The data plane's in-flight counts, telling the request's ticket (if any) each role it
    is placed on: the moment its grant becomes an engine's in-flight request."""

    def __init__(self, inner: InFlightCounts) -> None:
        self.inner = inner
        # Every other operation is the inner counts' own method: these run for every
        # candidate of every request, flow control on or off.
        self.enter = inner.enter
        self.leave = inner.leave
        self.of = inner.of
        self.add = inner.add
        self.remove = inner.remove

    def claim(self, role: str, choose: Choose) -> str | None:
        engine_id = self.inner.claim(role, choose)
        if engine_id is not None:
            ticket = _TICKET.get()
            if ticket is not None:
                ticket.placed_on(role, engine_id)
        return engine_id


def prompt_tokens(req: ClientRequest) -> int:
    """Its prompt's tokens: counted when the client sent ids, else estimated from the text;
    times its choices."""
    if req.batch is not None:
        prompts = req.batch
    elif req.prompt_token_count is not None:
        prompts = ([0] * req.prompt_token_count,)
    else:
        prompts = (req.prompt_text or "",)
    one = sum(
        len(p) if isinstance(p, list) else math.ceil(len(str(p)) / CHARS_PER_TOKEN) for p in prompts
    )
    return max(1, one * req.n)


class FlowGate:
    """Asks to start, and resolves the answers (`answer`) by request id."""

    def __init__(
        self, config: Config, link: FlowLink, worker: int, now: Callable[[], float]
    ) -> None:
        self._link = link
        self._worker = worker
        self._now = now
        self._pending: dict[str, asyncio.Future[Start | Refuse]] = {}
        self._resuming: set[str] = set()  # of `_pending`: streams waiting to go on
        self.preempt: Callable[[str], StepAside] = lambda request_id: StepAside.NEVER
        self.closed: tuple[str, str] | None = None  # (reason, message): nothing is asked
        self.reconfigure(config)

    def reconfigure(self, config: Config) -> None:
        self._cfg = config
        self._queue = config.flow_on
        self._max_wait_s = config.flow.max_wait_s
        # Whether `admit` has anything to do: flow control on, or a key with rate limits.
        # Off (the default), the data plane does not call it: no cost per request.
        self.active = self._queue or any(
            not Limits.of(policy).unlimited for policy in config.auth.key_policies.values()
        )

    @property
    def waiting(self) -> int:
        return len(self._pending)

    def answer(self, effect: FlowEffect) -> None:
        """The control side's answer to an ask of this data plane, or its request that a
        running stream step aside (`preempt`, set by the data plane: whether it did; never
        once this gate is closed: a stream cut then could not go on)."""
        if isinstance(effect, Preempt):
            answer = StepAside.NEVER if self.closed is not None else self.preempt(effect.id)
            if answer is not StepAside.NOW:
                self._link.send(Kept(effect.id, for_now=answer is StepAside.NOT_YET))
            return
        future = self._pending.pop(effect.id, None)
        if future is not None and not future.done():
            future.set_result(effect)

    def close(self, reason: str, message: str, withdraw: bool) -> None:
        """Answer every waiting request 503 now (`Retry-After: 1`): the control process is
        lost, or this worker drains (`withdraw`: tell the queue they left). A draining
        worker's streams waiting to go on keep waiting: they are in flight, and the queue
        may still grant them within the drain (their end, `Done`, settles what they used)."""
        self.closed = (reason, message)
        for request_id in list(self._pending):
            if withdraw:
                if request_id in self._resuming:
                    continue
                self._link.send(Withdraw(request_id))
            self.answer(Refuse(request_id, self._worker, 503, reason, message, 1, {}, 0))

    async def admit(
        self,
        req: ClientRequest | EmbeddingsRequest,
        exchange: Exchange,
        deadline: float,
        key: str | None,
    ) -> Ticket | Answer | None:
        """Whether `req` may start now: None (flow control has nothing to say: go), a
        `Ticket` (started: `finish` it), or the answer to send (refused, or a bad priority)."""
        _TICKET.set(None)  # a connection's earlier request may have left one in this context
        policy = self._cfg.auth.policy_for(key)
        queue = self._queue and isinstance(req, ClientRequest)
        priority = policy.priority
        if queue and isinstance(req, ClientRequest):  # the router orders: not the engines
            try:
                priority = resolve_priority(req.body, policy.priority)
            except PriorityError as exc:
                return bad_request(BadRequest(400, exc.message, param=exc.param))
            req.body.pop("priority", None)
        limited = key is not None and not Limits.of(policy).unlimited
        if not queue and not limited:
            return None
        record = exchange.record
        assert record is not None
        if self.closed is not None:
            reason, message = self.closed
            return _answer(
                Refuse(record.attempt_base, self._worker, 503, reason, message, 1, {}, 0)
            )
        tokens, rate_tokens = 1, 1
        if isinstance(req, ClientRequest):
            tokens = prompt_tokens(req)
            rate_tokens = tokens + (req.max_tokens or 0) * req.n * len(req.batch or (None,))
        client = key or exchange.header(TENANT_HEADER) or ""
        wait_s = min(self._max_wait_s, deadline - self._now())
        ask = Ask(
            record.attempt_base, req.model or self._cfg.model, client, key, priority, tokens,
            rate_tokens, wait_s, queue, self._worker, queue and self._preemptible(req),
        )  # fmt: skip
        effect = await self._wait(ask.id, ask)
        if isinstance(effect, Refuse):
            return _answer(effect)
        ticket = Ticket(ask.id, self._link, dict(effect.headers))
        _TICKET.set(ticket)
        return ticket

    def _preemptible(self, req: ClientRequest | EmbeddingsRequest) -> bool:
        """A stream that may migrate (one choice: `n` and batches are refused for streams):
        it can step aside and go on from its last token."""
        return (
            isinstance(req, ClientRequest)
            and req.stream
            and self._cfg.serving.migrations > 0
            and migratable(req.endpoint, req.body)
        )

    async def resume(self, deadline: float) -> None:
        """The current request was preempted and its leg is off its engine: wait for its
        turn to go on. `NotResumed` when it will not have one (the router stopped
        admitting), `DeadlineExceeded` when its deadline comes first."""
        ticket = _TICKET.get()
        if ticket is None:
            return  # not flow control's: nothing to wait for
        if self.closed is not None:
            raise NotResumed(self.closed[1])
        ticket.placed_anew()
        self._resuming.add(ticket.id)
        try:
            async with asyncio.timeout(max(0.0, deadline - self._now())):
                effect = await self._wait(ticket.id, Requeue(ticket.id))
        except TimeoutError:  # out of the queue already (`_wait`)
            raise DeadlineExceeded() from None
        finally:
            self._resuming.discard(ticket.id)
        if isinstance(effect, Refuse):
            raise NotResumed(effect.message)

    async def _wait(self, request_id: str, event: Ask | Requeue) -> Start | Refuse:
        """Send `event` and wait for the control side's answer to `request_id`. Cancelled
        (the client left, or the deadline came): an ask is withdrawn (out of the queue, its
        rate-limit share back); a stream waiting to go on is not, its ticket's `finish` ends
        it with the tokens it did use."""
        future: asyncio.Future[Start | Refuse] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = future
        try:
            self._link.send(event)
            return await future
        except asyncio.CancelledError:
            self._pending.pop(request_id, None)
            if isinstance(event, Ask):
                self._link.send(Withdraw(request_id))
            raise


def _answer(refused: Refuse) -> Answer:
    answer = error_answer(
        refused.status, refused.message, refused.error_type, _OUTCOMES[refused.status],
        retry_after_s=refused.retry_after_s, code=refused.code,
    )  # fmt: skip
    if refused.headers:
        headers: dict[str, Any] = {**refused.headers, **(answer.headers or {})}
        return Answer(answer.status, answer.body, answer.content_type, answer.outcome, headers)
    return answer


_OUTCOMES = {429: "rate_limited", 503: "not_admitted"}
