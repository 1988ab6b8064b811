"""`TokenLimits` (dataplane/token_limits.py): a prompt is checked against the smallest context
of its model's engines; only a prompt near the limit is counted, by an engine of the model
(`POST /tokenize` with the attempt's id and trace), once; a count that fails lets the
request go on. Each check is counted by its verdict."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from narwhal.clock import FakeClock
from narwhal.dataplane.leg import Attempt
from narwhal.dataplane.requests import BadRequest, parse_request
from narwhal.dataplane.token_limits import TokenLimits
from narwhal.dataplane.tokens import TokenBudget
from narwhal.engine.adapter import Endpoint
from narwhal.engine.failures import EngineFailure, FailureClass
from narwhal.engine.transport import Reply
from narwhal.fleet.events import ModelLimitLearned
from narwhal.telemetry.metrics import Children, DataMetrics
from tests.support.fake_engines import FakePost, fleet_config, serving_fleet

CONFIG = fleet_config(
    {"id": "p0", "role": "prefill"},
    {"id": "d0", "role": "decode"},
    {"id": "x0", "role": "both", "model": "other"},
    serving={"first_token_timeout_s": 3},
)
LONG = "word " * 40  # 200 bytes: past a 64-token bound, so it is counted


class World:
    def __init__(self, reply: Reply | Exception, limits: dict[str, int]) -> None:
        self.clock = FakeClock()
        fleet = serving_fleet(CONFIG, self.clock)
        for engine_id, limit in limits.items():
            fleet.apply(ModelLimitLearned(engine_id, limit), 0.0)
        self.client = FakePost(lambda url, body: reply)
        self.metrics = DataMetrics()
        self.limits = TokenLimits(
            fleet, self.client, self.clock, lambda e: None, TokenBudget(16),
            Children(self.metrics.token_checks), CONFIG,
        )  # fmt: skip

    async def check(self, body: dict[str, Any], endpoint: Endpoint = "completions") -> None:
        req = parse_request(endpoint, orjson.dumps(body), CONFIG.model)
        attempt = Attempt("req-a1", {"traceparent": "00-abc-def-01"})
        await self.limits.check(req, self.clock.monotonic() + 10, attempt)

    def verdicts(self) -> dict[str, float]:
        found = {}
        for metric in self.metrics.token_checks.collect():
            for sample in metric.samples:
                if sample.name.endswith("_total") and sample.value:
                    found[sample.labels["result"]] = sample.value
        return found


def _count(n: int) -> Reply:
    return Reply(200, orjson.dumps({"count": n, "tokens": list(range(n))}), "application/json")


async def test_a_short_prompt_is_never_counted_and_no_limit_means_no_check() -> None:
    world = World(_count(1), {"p0": 4096, "d0": 4096})
    await world.check({"prompt": "hi", "max_tokens": 8})
    unknown = World(_count(1), {})
    await unknown.check({"prompt": LONG})
    assert world.client.sent == unknown.client.sent == []
    assert world.verdicts() == {"fits_by_bound": 1}
    assert unknown.verdicts() == {"unknown_limit": 1}


async def test_a_prompt_near_the_limit_is_counted_once_by_an_engine_of_its_model() -> None:
    # x0 serves another model: its smaller context is not this model's.
    world = World(_count(50), {"p0": 100, "d0": 120, "x0": 10})
    await world.check({"prompt": LONG, "max_tokens": 40})
    await world.check({"prompt": LONG, "max_tokens": 40})
    [sent] = world.client.sent
    assert sent.url.endswith("/tokenize") and "9003" not in sent.url
    assert orjson.loads(sent.body) == {"model": "m", "prompt": LONG}
    assert sent.headers["X-Request-Id"] == "req-a1"
    assert sent.headers["traceparent"] == "00-abc-def-01"
    assert sent.timeout_s == 3
    assert world.verdicts() == {"counted": 1, "cached": 1}


async def test_a_counted_prompt_past_the_smallest_context_is_a_400() -> None:
    world = World(_count(50), {"p0": 100, "d0": 80})
    messages = [{"role": "user", "content": LONG}]
    with pytest.raises(BadRequest) as refused:
        await world.check({"messages": messages, "max_tokens": 40}, "chat")
    assert refused.value.status == 400
    assert "maximum context length is 80 tokens" in refused.value.message
    assert orjson.loads(world.client.sent[0].body) == {"model": "m", "messages": messages}


@pytest.mark.parametrize(
    "reply",
    [
        EngineFailure(FailureClass.CONNECTION, "refused"),
        Reply(500, b"{}", "application/json"),
        Reply(200, b"not json", "application/json"),
        Reply(200, b"[1]", "application/json"),
        Reply(200, b'{"count": "many"}', "application/json"),
    ],
)
async def test_a_count_that_fails_lets_the_request_go_on(reply: Reply | Exception) -> None:
    world = World(reply, {"p0": 100, "d0": 100})
    await world.check({"prompt": LONG, "max_tokens": 40})
    assert len(world.client.sent) == 1
    assert world.verdicts() == {"count_failed": 1}
