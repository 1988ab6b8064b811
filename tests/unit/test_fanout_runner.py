"""Fan-out's I/O (dataplane/fanout_runner.py): the parts of a batched or `n > 1` request run
through the serving policy, as many at once as the data connections free now allow (at most
`PARALLEL`), and their answers are merged in choice order whatever order they finish in; a
part that fails is the request's answer and the parts still running are cancelled. Every
extra connection goes back to the pool."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson

from narwhal.dataplane.exchange import Answer, Exchange, Result
from narwhal.dataplane.fanout import PARALLEL
from narwhal.dataplane.fanout_runner import FanOut
from narwhal.dataplane.pool import Pool
from narwhal.dataplane.requests import ClientRequest, parse_request
from tests.support.fake_exchange import FakeExchange


def _request(body: dict[str, Any]) -> ClientRequest:
    return parse_request("completions", orjson.dumps(body), "m")


def _answer(part: ClientRequest) -> Answer:
    text = f"{part.body['prompt']}/{part.body.get('seed')}"
    usage = {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}
    doc = {"id": "cmpl-1", "choices": [{"index": 0, "text": text}], "usage": usage}
    return Answer(200, orjson.dumps(doc), "application/json")


class Parts:
    """The policy's side: each part answered after a few loop turns (later parts sooner, so
    they finish out of order), with the number running at once kept."""

    def __init__(self, fail: str | None = None) -> None:
        self.fail = fail  # the prompt whose part is refused
        self.started: list[str] = []
        self.cancelled: list[str] = []
        self.running = self.peak = 0

    async def serve(self, part: ClientRequest, exchange: Exchange, deadline: float) -> Result:
        prompt = part.body["prompt"]
        self.started.append(prompt)
        self.running += 1
        self.peak = max(self.peak, self.running)
        try:
            if prompt == self.fail:
                return Answer(400, b'{"error": "refused"}', "application/json", "client_error")
            if prompt == "forever":
                await asyncio.Event().wait()
            for _ in range(10 - len(self.started)):
                await asyncio.sleep(0)
            return _answer(part)
        except asyncio.CancelledError:
            self.cancelled.append(prompt)
            raise
        finally:
            self.running -= 1


async def _run(req: ClientRequest, parts: Parts, free: int) -> tuple[Answer, Pool]:
    pool = Pool("data", 1 + free)
    assert pool.try_acquire()  # the request's own connection
    answer = await FanOut(pool, parts.serve).answer(req, FakeExchange(), 10.0)
    return answer, pool


async def test_parts_are_merged_in_choice_order_whatever_order_they_finish_in() -> None:
    parts = Parts()
    req = _request({"prompt": ["a", "b", "c"], "n": 2, "seed": 5})
    answer, pool = await _run(req, parts, free=8)
    assert answer.status == 200
    doc = orjson.loads(answer.body)
    assert [(c["index"], c["text"]) for c in doc["choices"]] == [
        (0, "a/5"), (1, "a/6"), (2, "b/5"), (3, "b/6"), (4, "c/5"), (5, "c/6"),
    ]  # fmt: skip
    assert doc["usage"] == {"prompt_tokens": 6, "completion_tokens": 6, "total_tokens": 12}
    assert parts.peak == 6  # one connection each: the request's and five free ones
    assert pool.in_use == 1  # the extra ones went back


async def test_parts_take_turns_on_the_connections_free_now_at_most_parallel() -> None:
    one = Parts()
    answer, pool = await _run(_request({"prompt": "x", "n": 3}), one, free=0)
    assert answer.status == 200 and one.peak == 1 and pool.in_use == 1
    many = Parts()
    prompts = [f"p{i}" for i in range(PARALLEL + 4)]
    answer, pool = await _run(_request({"prompt": prompts}), many, free=100)
    assert answer.status == 200 and many.peak == PARALLEL and pool.in_use == 1


async def test_a_failed_part_is_the_answer_and_cancels_the_parts_still_running() -> None:
    parts = Parts(fail="b")
    answer, pool = await _run(_request({"prompt": ["forever", "b", "c"]}), parts, free=2)
    assert (answer.status, answer.body) == (400, b'{"error": "refused"}')
    assert "forever" in parts.cancelled
    assert parts.running == 0
    assert pool.in_use == 1
