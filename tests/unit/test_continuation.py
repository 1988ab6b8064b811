"""Migration's I/O (dataplane/continuation.py): a broken stream is continued as attempts of
the data plane's, each from what the client already has, while `serving.migrations` and the
deadline allow; a stream that cannot go on ends with the error event, and one whose every
token was delivered ends normally. Each continuation is counted, noted and logged; a chat
whose engine gives no prompt ids has its prompt rendered once. A request the prefill alone
completed reaches the client through the splice too."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from narwhal.clock import FakeClock
from narwhal.config import EngineConfig
from narwhal.dataplane.continuation import Continuations, continued
from narwhal.dataplane.exchange import Answer, Exchange, Result, Streamed
from narwhal.dataplane.leg import Attempt
from narwhal.dataplane.migration import TOKEN_IDS, Continuation, Splice
from narwhal.dataplane.moves import PREEMPTED
from narwhal.dataplane.outcomes import DeadlineExceeded, Interrupted, NotResumed, status_for
from narwhal.dataplane.policy import Limits
from narwhal.dataplane.record import RequestRecord
from narwhal.dataplane.requests import ClientRequest
from narwhal.engine.failures import EngineFailure, FailureClass
from narwhal.engine.transport import PoolKind
from narwhal.telemetry.metrics import Children, DataMetrics
from tests.support.fake_engines import fleet_config, serving_fleet
from tests.support.fake_exchange import FakeExchange

CONFIG = fleet_config(
    {"id": "p0", "role": "prefill", "api_key": "key-p0"},
    {"id": "d0", "role": "decode"},
    serving={"first_token_timeout_s": 3},
)
HEAD = {"id": "cmpl-1", "created": 100, "model": "m", "object": "text_completion"}
DONE = b"data: [DONE]\n\n"


def _sse(*events: dict[str, Any]) -> bytes:
    return b"".join(b"data: " + orjson.dumps(event) + b"\n\n" for event in events)


def _cmpl(text: str, ids: list[int], **choice: Any) -> dict[str, Any]:
    return {**HEAD, "choices": [{"index": 0, "text": text, "token_ids": ids, **choice}]}


def _broken(body: dict[str, Any], finish: str | None = None) -> Splice:
    """A completions stream that delivered " a" and " b" (ids 11, 12) over prompt [1, 2, 3]
    before its leg failed."""
    splice = Splice("completions", body, False)
    splice.relay(
        _sse(_cmpl(" a", [11], prompt_token_ids=[1, 2, 3]), _cmpl(" b", [12], finish_reason=finish))
    )
    splice.opened = True
    return splice


def _interrupted(engine_id: str = "d0") -> Interrupted:
    return Interrupted(EngineFailure(FailureClass.STREAM, "cut"), "stream", engine_id)


class FakeAdapter:
    def __init__(self, world: World) -> None:
        self._world = world

    async def rendered_chat(
        self,
        pool: PoolKind,
        engine: EngineConfig,
        chat_body: dict[str, Any],
        headers: Mapping[str, str],
        timeout_s: float,
    ) -> str | None:
        self._world.rendered.append((engine.id, headers.get("Authorization"), timeout_s))
        return "<user>hi</user>"


class World:
    """Continuations over a real fleet; the data plane's attempts answer from `script`."""

    def __init__(self, *script: Result | Exception) -> None:
        self.clock = FakeClock()
        self.script = list(script)
        self.attempts: list[tuple[ClientRequest, Attempt]] = []
        self.errors: list[Exception] = []
        self.notes: list[tuple[str, str | None, str]] = []
        self.rendered: list[tuple[str, str | None, float]] = []
        self.settled = 0
        self.metrics = DataMetrics()
        adapter = FakeAdapter(self)
        ids = iter(f"side-{i}" for i in range(100))
        self.continuations = Continuations(
            serving_fleet(CONFIG, self.clock), self.clock, lambda engine: adapter,
            lambda e: e.api_key, lambda: next(ids), self.attempt, self.error_event,
            self.settle, Children(self.metrics.migrations),
            Children(self.metrics.migrated_streams),
            lambda kind, engine, what: self.notes.append((kind, engine, what)), CONFIG,
            self.resume,
        )  # fmt: skip
        self.resumes: list[Exception | None] = []  # what each preempted wait ends with
        self.record = RequestRecord("req", "completions", "req")
        self.record.attempts = 1  # the first attempt's
        self.exchange = FakeExchange(record=self.record)

    async def attempt(
        self,
        req: ClientRequest,
        exchange: Exchange,
        deadline: float,
        attempt: Attempt,
        tried: set[str],
    ) -> Result:
        self.attempts.append((req, attempt))
        step = self.script.pop(0)
        if isinstance(step, Exception):
            raise step
        return step

    async def error_event(self, exchange: Exchange, failure: Exception, until: float) -> Result:
        self.errors.append(failure)
        return Streamed("upstream_error_midstream")

    async def settle(self) -> None:
        self.settled += 1

    async def resume(self, deadline: float) -> None:
        """Flow control's answer to a preempted stream's wait: its turn, or a refusal."""
        outcome = self.resumes.pop(0)
        if outcome is not None:
            raise outcome

    async def migrate(
        self,
        splice: Splice,
        migrations: int = 2,
        deadline_s: float = 10,
        interrupted: Interrupted | None = None,
    ) -> Result:
        deadline = self.clock.monotonic() + deadline_s
        limits = Limits(attempts=1, migrations=migrations)
        return await self.continuations.migrate(
            self.exchange, deadline, splice, interrupted or _interrupted(), set(), limits
        )

    def counted(self, metric: Any) -> dict[tuple[str, ...], float]:
        return {
            tuple(s.labels.values()): s.value
            for m in metric.collect()
            for s in m.samples
            if s.name.endswith("_total")
        }


def test_a_continuation_is_a_stream_of_the_same_model() -> None:
    body = {"prompt": [1, 11], "max_tokens": 3, "stream_options": {"include_usage": True}}
    req = continued(Continuation("completions", body, TOKEN_IDS), "m")
    assert (req.endpoint, req.body, req.stream) == ("completions", body, True)
    assert req.include_usage
    assert (req.max_tokens, req.model, req.prompt_text, req.n) == (3, "m", None, 1)
    assert not continued(Continuation("chat", {"messages": []}, "text"), "m").include_usage


async def test_a_broken_stream_goes_on_from_the_delivered_tokens() -> None:
    world = World(Streamed("ok"))
    splice = _broken({"prompt": "hi", "max_tokens": 10})
    assert await world.migrate(splice) == Streamed("ok")
    [(req, attempt)] = world.attempts
    assert req.body["prompt"] == [1, 2, 3, 11, 12] and req.body["max_tokens"] == 8
    assert req.stream and req.model == "m"
    assert attempt.request_id == "req-a2" and attempt.splice is splice
    assert world.record.migrations == splice.migrations == 1
    # The request's tokens are the whole stream's (the access log, flow control's Done).
    assert world.record.to_json()["prompt_tokens"] == 3
    assert world.record.to_json()["completion_tokens"] == 2
    assert world.counted(world.metrics.migrations) == {("stream", TOKEN_IDS): 1}
    [(kind, engine, what)] = world.notes
    assert (kind, engine) == ("migration", "d0") and "continued after 2 tokens" in what
    assert world.errors == []


async def test_a_stream_no_continuation_can_save_ends_with_the_error_event() -> None:
    again = Interrupted(EngineFailure(FailureClass.CONNECTION, "gone"), "connection", "d1")
    world = World(again, EngineFailure(FailureClass.TIMEOUT, "no first byte"))
    result = await world.migrate(_broken({"prompt": "hi", "max_tokens": 10}), migrations=2)
    assert result == Streamed("upstream_error_midstream")
    assert [a.request_id for _, a in world.attempts] == ["req-a2", "req-a3"]
    [failure] = world.errors
    assert isinstance(failure, EngineFailure) and failure.failure_class is FailureClass.TIMEOUT
    assert world.counted(world.metrics.migrated_streams) == {("lost",): 1}
    assert world.counted(world.metrics.migrations) == {
        ("stream", TOKEN_IDS): 1, ("connection", TOKEN_IDS): 1,
    }  # fmt: skip
    assert "lost after 2 tokens and 2 migrations (timeout)" in world.notes[-1][2]
    assert world.record.to_json()["completion_tokens"] == 2  # lost: what it did use
    assert world.notes[-1][1] == "d1"  # the engine the stream last left


async def test_no_continuation_once_the_migrations_or_the_deadline_are_spent() -> None:
    for migrations, deadline_s in ((0, 10.0), (2, 0.0)):
        world = World()
        result = await world.migrate(_broken({"prompt": "hi"}), migrations, deadline_s)
        assert result == Streamed("upstream_error_midstream")
        assert world.attempts == []


async def test_a_stream_whose_every_token_was_delivered_ends_normally() -> None:
    world = World()
    splice = _broken({"prompt": "hi", "max_tokens": 10}, finish="length")
    assert await world.migrate(splice) == Streamed("ok")
    assert world.attempts == [] and world.errors == []
    assert world.exchange.sent == [DONE] and world.exchange.ended
    assert world.settled == 1
    assert world.counted(world.metrics.migrated_streams) == {("saved",): 1}


async def test_a_chat_without_prompt_ids_has_its_prompt_rendered_once() -> None:
    again = Interrupted(EngineFailure(FailureClass.STREAM, "cut"), "stream", "d0")
    world = World(again, Streamed("ok"))
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "stream": True}
    splice = Splice("chat", body, False, "logprobs")
    splice.opened = True
    assert await world.migrate(splice) == Streamed("ok")
    assert world.rendered == [("p0", "Bearer key-p0", 3)]
    assert [req.body["prompt"] for req, _ in world.attempts] == [["<user>hi</user>"]] * 2


async def test_a_request_the_prefill_completed_reaches_the_client_through_its_splice() -> None:
    world = World()
    stream = _sse(_cmpl(" a", [11], finish_reason="length")) + DONE
    answer = Answer(200, stream, "text/event-stream")
    attempt = Attempt("req-a1", {})
    deadline = world.clock.monotonic() + 10
    finished = world.continuations.finished_in_prefill
    assert await finished(world.exchange, deadline, attempt, answer) is answer  # no splice
    attempt.splice = Splice("completions", {"prompt": "hi"}, False)
    before = await finished(world.exchange, deadline, attempt, answer)  # not begun: rewritten
    assert isinstance(before, Answer) and before.status == 200
    events = [e for e in before.body.split(b"\n\n") if e]
    assert len(events) == 2 and b"token_ids" not in before.body  # the client asked for none
    attempt.splice = Splice("completions", {"prompt": "hi"}, False)
    attempt.splice.opened = True  # a continuation: the stream began
    assert await finished(world.exchange, deadline, attempt, answer) == Streamed("ok")
    assert world.exchange.sent[-1].endswith(DONE) and world.exchange.ended
    gone = FakeExchange()
    gone.gone = True
    attempt.splice = Splice("completions", {"prompt": "hi"}, False)
    attempt.splice.opened = True
    assert await finished(gone, deadline, attempt, answer) == Streamed("client_disconnect")
    assert world.counted(world.metrics.migrated_streams) == {("saved",): 2}


def _preempted() -> Interrupted:
    return Interrupted(EngineFailure(FailureClass.STREAM, "preempted"), PREEMPTED, "d0")


async def test_a_preempted_stream_waits_for_its_turn_then_goes_on() -> None:
    world = World(Streamed("ok"), Streamed("ok"))
    world.resumes = [None]
    assert await world.migrate(_broken({"prompt": "x"}), interrupted=_preempted()) == Streamed("ok")
    assert world.resumes == []  # it waited once, then went on
    assert len(world.attempts) == 1
    assert world.counted(world.metrics.migrations) == {("preempted", TOKEN_IDS): 1.0}
    # Interrupted again, by a failure this time: it goes on at once, without waiting.
    world = World(_interrupted(), Streamed("ok"))
    world.resumes = [None]
    assert await world.migrate(_broken({"prompt": "x"}), interrupted=_preempted()) == Streamed("ok")
    assert len(world.attempts) == 2 and world.resumes == []


async def test_a_preempted_stream_refused_its_turn_ends_with_the_error_event() -> None:
    for refusal in (NotResumed("not admitting requests: lease lost"), DeadlineExceeded()):
        world = World()
        world.resumes = [refusal]
        result = await world.migrate(_broken({"prompt": "x"}), interrupted=_preempted())
        assert result == Streamed("upstream_error_midstream")
        assert world.errors == [refusal]
        assert world.attempts == []
        assert status_for(refusal)[0] in (503, 504)
