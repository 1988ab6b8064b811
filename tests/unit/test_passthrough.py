"""`/tokenize` and `/detokenize` (dataplane/passthrough.py): the client's bytes, unchanged,
to the least busy eligible engine of the body's model with that engine's key; its answer is
the client's, counted by what it says. A body the router can judge wrong never reaches an
engine."""

from __future__ import annotations

import orjson
import pytest

from narwhal.clock import FakeClock
from narwhal.dataplane.passthrough import Passthrough
from narwhal.engine.failures import EngineFailure, FailureClass
from narwhal.engine.transport import Reply
from narwhal.fleet.store import Fleet
from tests.support.fake_engines import FakePost, fleet_config
from tests.support.fake_exchange import FakeExchange
from tests.support.fleet import set_in_flight, verify_all

CONFIG = fleet_config(
    {"id": "p0", "role": "prefill", "api_key": "key-p0"},
    {"id": "d0", "role": "decode", "api_key": "key-d0"},
    serving={"first_token_timeout_s": 3, "max_body_bytes": 1024},
)


def _passthrough(reply: Reply | Exception, verified: bool = True) -> tuple[Passthrough, FakePost]:
    clock = FakeClock()
    fleet = Fleet(CONFIG.engines, clock)
    if verified:
        verify_all(fleet)
    set_in_flight(fleet, "p0", 2)
    client = FakePost(lambda url, body: reply)
    ids = iter(f"r{i}" for i in range(100))
    return Passthrough(fleet, client, clock, lambda e: e.api_key, lambda: next(ids), CONFIG), client


async def test_the_body_goes_as_it_is_to_the_least_busy_engine_and_its_answer_back() -> None:
    passthrough, client = _passthrough(Reply(200, b'{"count": 3}', "application/json"))
    raw = b'{"model": "m",  "prompt": "a b c"}'
    answer = await passthrough.answer("/tokenize", FakeExchange([raw]))
    assert (answer.status, answer.body, answer.outcome) == (200, b'{"count": 3}', "ok")
    [sent] = client.sent
    assert sent.url == "http://127.0.0.1:9002/tokenize"  # d0: p0 has two in flight
    assert sent.body is raw
    assert sent.headers["Authorization"] == "Bearer key-d0"
    assert sent.headers["X-Request-Id"] == "r0"
    assert sent.timeout_s == 3


@pytest.mark.parametrize(
    ("status", "outcome"), [(201, "ok"), (400, "client_error"), (500, "upstream_error")]
)
async def test_the_engines_status_is_the_clients(status: int, outcome: str) -> None:
    passthrough, _ = _passthrough(Reply(status, b"{}", "application/json"))
    answer = await passthrough.answer("/detokenize", FakeExchange([b'{"tokens": [1]}']))
    assert (answer.status, answer.outcome) == (status, outcome)


@pytest.mark.parametrize(
    ("raw", "status"),
    [
        (b"{not json", 400),
        (b"[1, 2]", 400),
        (b'{"model": 7}', 400),
        (b'{"model": "other"}', 404),
        (b'{"model": "m", "prompt": "' + b"x" * 2000 + b'"}', 413),
    ],
)
async def test_a_body_the_router_can_judge_never_reaches_an_engine(raw: bytes, status: int) -> None:
    passthrough, client = _passthrough(Reply(200, b"{}", "application/json"))
    answer = await passthrough.answer("/tokenize", FakeExchange([raw]))
    assert answer.status == status
    assert orjson.loads(answer.body)["error"]["message"]
    assert client.sent == []


async def test_no_eligible_engine_is_a_503_and_an_engine_failure_a_502() -> None:
    passthrough, client = _passthrough(Reply(200, b"{}", "application/json"), verified=False)
    answer = await passthrough.answer("/tokenize", FakeExchange([b"{}"]))
    assert (answer.status, answer.outcome) == (503, "no_capacity")
    assert answer.headers == {"Retry-After": "1"}
    assert client.sent == []
    failing, _ = _passthrough(EngineFailure(FailureClass.CONNECTION, "refused"))
    answer = await failing.answer("/tokenize", FakeExchange([b"{}"]))
    assert (answer.status, answer.outcome) == (502, "upstream_error")


async def test_a_reloaded_config_names_the_default_model() -> None:
    passthrough, client = _passthrough(Reply(200, b"{}", "application/json"))
    passthrough.config = CONFIG.model_copy(update={"model": "gone"})
    answer = await passthrough.answer("/tokenize", FakeExchange([b'{"prompt": "x"}']))
    assert answer.status == 404  # no engine serves the new default
    assert client.sent == []
