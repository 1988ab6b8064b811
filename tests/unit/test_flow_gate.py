"""The data plane's side of flow control (`dataplane/flow_gate.py`): when it has anything to
do at all (the data plane skips it otherwise, so flow control off costs nothing per request),
and what it does to the body's `priority` with the queue on and off."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest

from narwhal.config import Config
from narwhal.dataplane.exchange import Answer, Exchange
from narwhal.dataplane.flow_gate import FlowGate, Ticket
from narwhal.dataplane.outcomes import DeadlineExceeded
from narwhal.dataplane.policy import StepAside
from narwhal.dataplane.record import RequestRecord
from narwhal.dataplane.requests import ClientRequest, parse_request
from narwhal.flow.messages import (
    Ask,
    Begun,
    Done,
    FromDataPlane,
    Kept,
    Preempt,
    Requeue,
    Start,
    Withdraw,
)
from tests.support.fake_exchange import FakeExchange

KEY = "a" * 12  # a key's label


def config(**sections: Any) -> Config:
    base: dict[str, Any] = {
        "model": "m",
        "engines": [{"id": "p0", "url": "http://10.0.0.1:8000", "role": "both"}],
    }
    return Config.model_validate({**base, **sections})


class StartAtOnce:
    """The control side, granting every ask as it is sent."""

    def __init__(self) -> None:
        self.gate: FlowGate | None = None
        self.asks: list[Ask] = []
        self.sent: list[FromDataPlane] = []
        self.grant_requeues = True
        self.grant_asks = True

    def send(self, event: FromDataPlane) -> None:
        self.sent.append(event)
        if isinstance(event, Requeue) and self.grant_requeues:
            assert self.gate is not None
            self.gate.answer(Start(event.id, 0, 0, 0.0))
        if isinstance(event, Ask):
            self.asks.append(event)
            assert self.gate is not None
            if self.grant_asks:
                self.gate.answer(Start(event.id, 0, event.priority, 0.0))


async def admitted(gate: FlowGate, body: bytes) -> tuple[object, ClientRequest]:
    """`body` as a completions request, through `gate.admit`: (what it answered, the request)."""
    req = parse_request("completions", body, "m")
    exchange = FakeExchange(record=RequestRecord("r1", "completions", "r1"))
    return await gate.admit(req, cast(Exchange, exchange), 10.0, None), req


def gate_for(cfg: Config) -> tuple[FlowGate, StartAtOnce]:
    link = StartAtOnce()
    gate = FlowGate(cfg, link, 0, lambda: 0.0)
    link.gate = gate
    return gate, link


@pytest.mark.parametrize(
    ("sections", "active"),
    [
        ({}, False),  # the default: single_attempt, no key policies
        ({"serving": {"policy": "bounded"}}, True),  # flow control on under bounded
        ({"serving": {"policy": "bounded"}, "flow": {"enabled": False}}, False),
        ({"flow": {"enabled": True}}, True),
    ],
)
def test_the_gate_is_active_only_with_flow_control_or_a_rate_limited_key(
    sections: dict[str, Any], active: bool
) -> None:
    gate, _ = gate_for(config(**sections))
    assert gate.active is active


async def test_with_the_queue_on_priority_is_read_and_not_sent_to_the_engine() -> None:
    gate, link = gate_for(config(serving={"policy": "bounded"}))
    ticket, req = await admitted(gate, b'{"prompt": "x", "priority": 3}')
    assert isinstance(ticket, Ticket)
    assert [a.priority for a in link.asks] == [3]
    assert "priority" not in req.body


async def test_with_the_queue_off_priority_goes_to_the_engine_as_sent() -> None:
    gate, link = gate_for(config(flow={"enabled": False}))
    answer, req = await admitted(gate, b'{"prompt": "x", "priority": 3}')
    assert answer is None
    assert link.asks == []
    assert req.body["priority"] == 3


@pytest.mark.parametrize(
    ("body", "preemptible"),
    [
        (b'{"prompt": "x", "stream": true}', True),
        (b'{"prompt": "x"}', False),  # not a stream: it cannot go on from a token
        (b'{"prompt": "x", "stream": true, "response_format": {"type": "json_object"}}', False),
    ],
)
async def test_only_a_stream_that_may_migrate_is_preemptible(
    body: bytes, preemptible: bool
) -> None:
    gate, link = gate_for(config(serving={"policy": "bounded"}))
    await admitted(gate, body)
    assert [a.preemptible for a in link.asks] == [preemptible]
    gate, link = gate_for(config(serving={"policy": "bounded", "migration_limit": 0}))
    await admitted(gate, body)
    assert [a.preemptible for a in link.asks] == [False]


async def test_a_preemption_is_kept_when_the_data_plane_cannot_step_aside() -> None:
    gate, link = gate_for(config(serving={"policy": "bounded"}))
    asked: list[str] = []
    answers = {"r1": StepAside.NEVER, "r2": StepAside.NOW, "r3": StepAside.NOT_YET}
    gate.preempt = lambda request_id: asked.append(request_id) or answers[request_id]
    gate.answer(Preempt("r1", 0, 2))
    gate.answer(Preempt("r2", 0, 2))
    gate.answer(Preempt("r3", 0, 2))
    assert asked == ["r1", "r2", "r3"]
    assert link.sent == [Kept("r1"), Kept("r3", for_now=True)]


async def test_a_preempted_request_requeues_and_its_legs_are_placed_anew() -> None:
    gate, link = gate_for(config(serving={"policy": "bounded"}))
    ticket, _ = await admitted(gate, b'{"prompt": "x", "stream": true}')
    assert isinstance(ticket, Ticket)
    ticket.placed_on("decode", "d0")
    ticket.placed_on("decode", "d0")  # told once per grant
    await gate.resume(10.0)
    ticket.placed_on("decode", "d1")
    begun = [(e.role, e.engine) for e in link.sent if not isinstance(e, Ask | Requeue)]
    assert begun == [("decode", "d0"), ("decode", "d1")]
    assert Requeue("r1") in link.sent


async def test_a_preempted_request_whose_deadline_passes_ends_with_the_tokens_it_used() -> None:
    """Not withdrawn (that would give its key back every token): the stream ends, and its
    ticket's `finish` tells what it used."""
    gate, link = gate_for(config(serving={"policy": "bounded"}))
    link.grant_requeues = False
    ticket, _ = await admitted(gate, b'{"prompt": "x", "stream": true}')
    assert isinstance(ticket, Ticket)
    with pytest.raises(DeadlineExceeded):
        await gate.resume(0.0)  # the gate's clock says 0: no time left
    assert link.sent[-1] == Requeue("r1")
    assert gate.waiting == 0
    usage = b'data: {"usage": {"prompt_tokens": 5, "completion_tokens": 7}}'
    ticket.finish(None, usage)
    assert link.sent[-1] == Done("r1", 7, 5)
    assert not any(isinstance(e, Withdraw) for e in link.sent)


async def test_a_client_leaving_while_its_request_waits_withdraws_it() -> None:
    gate, link = gate_for(config(serving={"policy": "bounded"}))
    link.grant_asks = False
    waiting = asyncio.create_task(admitted(gate, b'{"prompt": "x"}'))
    await asyncio.sleep(0)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert link.sent == [link.asks[0], Withdraw("r1")]


async def test_a_draining_gate_keeps_streams_waiting_to_go_on_and_asks_none_to_step_aside() -> None:
    """A draining worker withdraws and answers its waiting asks, but a stream waiting to go
    on is in flight: it keeps waiting for its grant within the drain, never withdrawn (that
    would give its key back what it used). Once closed, no stream steps aside."""
    gate, link = gate_for(config(serving={"policy": "bounded"}))
    link.grant_requeues = False
    ticket, _ = await admitted(gate, b'{"prompt": "x", "stream": true}')
    assert isinstance(ticket, Ticket)
    resuming = asyncio.create_task(gate.resume(10.0))
    await asyncio.sleep(0)
    link.grant_asks = False
    exchange = FakeExchange(record=RequestRecord("r2", "completions", "r2"))
    req = parse_request("completions", b'{"prompt": "y"}', "m")
    asking = asyncio.create_task(gate.admit(req, cast(Exchange, exchange), 10.0, None))
    await asyncio.sleep(0)
    cut: list[str] = []
    gate.preempt = lambda request_id: cut.append(request_id) or StepAside.NOW
    gate.close("not_admitted", "not admitting requests: draining", True)
    refused = await asking
    assert isinstance(refused, Answer) and refused.status == 503
    assert Withdraw("r2") in link.sent and Withdraw("r1") not in link.sent
    assert not resuming.done()
    gate.answer(Preempt("r1", 0, 2))
    assert cut == [] and link.sent[-1] == Kept("r1")
    gate.answer(Start("r1", 0, 2, 0.0))  # granted within the drain: it goes on
    await resuming


async def test_a_leg_placed_on_another_engine_is_told_again() -> None:
    """A retry or a migration within one grant placed elsewhere: flow control judges a
    preemption by the engine the stream is on now."""
    gate, link = gate_for(config(serving={"policy": "bounded"}))
    ticket, _ = await admitted(gate, b'{"prompt": "x", "stream": true}')
    assert isinstance(ticket, Ticket)
    for engine_id in ("d0", "d0", "d1"):
        ticket.placed_on("decode", engine_id)
    assert [(e.role, e.engine) for e in link.sent if isinstance(e, Begun)] == [
        ("decode", "d0"),
        ("decode", "d1"),
    ]
