"""`/v1/embeddings` (dataplane/embeddings.py): a model that does not embed is refused before
any placement; an embed attempt that fails is retried on another engine while the policy
allows (`bounded`, within the deadline), each retry counted by its reason; the engine's 4xx,
no capacity and the request's deadline end the request at once."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import orjson

from narwhal.clock import FakeClock
from narwhal.config import Role
from narwhal.dataplane.embeddings import Embeddings
from narwhal.dataplane.exchange import Answer, Exchange
from narwhal.dataplane.leg import Attempt, Leg
from narwhal.dataplane.outcomes import DeadlineExceeded, NoCapacity
from narwhal.dataplane.policy import Limits
from narwhal.dataplane.record import RequestRecord
from narwhal.dataplane.requests import EmbeddingsRequest, parse_embeddings
from narwhal.engine.failures import ClientError, EngineFailure, FailureClass
from narwhal.fleet.state import EngineState
from narwhal.telemetry.metrics import DataMetrics
from tests.support.fake_engines import fleet_config, serving_fleet
from tests.support.fake_exchange import FakeExchange

CONFIG = fleet_config(
    {"id": "p0", "role": "prefill"},
    {"id": "d0", "role": "decode"},
    {"id": "e0", "role": "embed", "model": "emb"},
    {"id": "e1", "role": "embed", "model": "emb"},
)
EMBEDDING = Answer(200, b'{"data": [{"embedding": [0.5]}]}', "application/json")
BOUNDED, ONE = Limits(attempts=3, migrations=0), Limits(attempts=1, migrations=0)


class World:
    """Embeddings over a real fleet, with placement in id order (an engine tried once is not
    placed again) and embed legs answering from `script`, in order."""

    def __init__(self, *script: Answer | Exception) -> None:
        self.clock = FakeClock()
        self.fleet = serving_fleet(CONFIG, self.clock)
        self.script = list(script)
        self.legs: list[tuple[str, str, str]] = []  # (leg, engine, attempt id)
        self.traced: list[tuple[str, str]] = []
        self.metrics = DataMetrics()
        self.embeddings = Embeddings(
            self.fleet, self.clock, self.place, self.trace, self.new_leg, self.embed,
            self.metrics.retries,
        )  # fmt: skip

    @contextmanager
    def place(self, role: Role, tried: set[str], model: str | None) -> Iterator[EngineState]:
        candidates = self.fleet.candidates(role, self.clock.monotonic(), model)
        for candidate in sorted(c.id for c in candidates):
            if candidate not in tried:
                tried.add(candidate)
                yield self.fleet.get(candidate)
                return
        raise NoCapacity(role)

    def trace(
        self, exchange: Exchange, attempt: Attempt, leg: str, engine_id: str
    ) -> AbstractContextManager[None]:
        self.traced.append((leg, engine_id))
        return nullcontext()

    def new_leg(
        self, name: str, engine: EngineState, attempt: Attempt, deadline: float, body: Any
    ) -> Leg:
        return Leg(name, engine, attempt, deadline, {}, body)

    async def embed(self, req: EmbeddingsRequest, leg: Leg, now: float) -> Answer:
        self.legs.append((leg.name, leg.engine.id, leg.attempt.request_id))
        step = self.script.pop(0)
        if isinstance(step, Exception):
            raise step
        return step

    async def answer(
        self, model: str = "emb", limits: Limits = BOUNDED, deadline_s: float = 10.0
    ) -> tuple[Answer, RequestRecord]:
        record = RequestRecord("req", "embeddings", "req")
        req = parse_embeddings(orjson.dumps({"model": model, "input": "hi"}), CONFIG.model)
        exchange = FakeExchange(record=record)
        deadline = self.clock.monotonic() + deadline_s
        return await self.embeddings.answer(req, exchange, deadline, limits), record

    def retries(self) -> dict[str, float]:
        return {
            s.labels["reason"]: s.value
            for m in self.metrics.retries.collect()
            for s in m.samples
            if s.name.endswith("_total")
        }


async def test_a_failed_attempt_is_retried_on_another_engine_under_bounded() -> None:
    world = World(EngineFailure(FailureClass.CONNECTION, "refused"), EMBEDDING)
    answer, record = await world.answer()
    assert answer is EMBEDDING
    assert world.legs == [("embed", "e0", "req-a1"), ("embed", "e1", "req-a2")]
    assert world.traced == [("embed", "e0"), ("embed", "e1")]
    assert (record.prefill, record.decode) == (None, "e1")
    assert world.retries() == {"connection": 1}


async def test_one_attempt_under_single_attempt_and_none_past_the_deadline() -> None:
    world = World(EngineFailure(FailureClass.TIMEOUT, "slow"), EMBEDDING)
    answer, _ = await world.answer(limits=ONE)
    assert (answer.status, answer.outcome) == (504, "upstream_timeout")
    assert len(world.legs) == 1
    late = World(EngineFailure(FailureClass.CONNECTION, "refused"), EMBEDDING)
    answer, _ = await late.answer(deadline_s=0.0)  # the deadline is now
    assert (answer.status, answer.outcome) == (502, "upstream_error")
    assert len(late.legs) == 1
    assert world.retries() == late.retries() == {}


async def test_the_engines_4xx_no_capacity_and_the_deadline_end_the_request() -> None:
    refused = ClientError(400, b'{"error": "bad input"}', "application/json")
    world = World(refused)
    answer, _ = await world.answer()
    assert (answer.status, answer.body, answer.outcome) == (400, refused.body, "client_error")
    world = World(DeadlineExceeded())
    answer, _ = await world.answer()
    assert (answer.status, answer.outcome) == (504, "deadline")
    world = World(*[EngineFailure(FailureClass.CONNECTION, "refused")] * 2)
    answer, _ = await world.answer()  # both engines failed; a third attempt finds none
    assert (answer.status, answer.outcome) == (503, "no_capacity")
    assert len(world.legs) == 2


async def test_a_model_that_does_not_embed_is_refused_before_placement() -> None:
    world = World(EMBEDDING)
    answer, record = await world.answer(model="m")
    assert answer.status == 400
    assert orjson.loads(answer.body)["error"]["code"] == "model_not_supported"
    assert world.legs == [] and record.attempts == 0
