"""`read_body` (dataplane/body.py): the whole body from its chunks, a 413 past the limit
whether the client declared the size or only sent it."""

from __future__ import annotations

import pytest

from narwhal.dataplane.body import read_body
from narwhal.dataplane.requests import BadRequest
from tests.support.fake_exchange import FakeExchange


async def test_the_chunks_are_joined_and_one_chunk_is_returned_as_it_is() -> None:
    assert await read_body(FakeExchange([b"ab", b"c", b"de"]), 5) == b"abcde"
    one = b"x" * 5
    assert await read_body(FakeExchange([one]), 5) is one
    assert await read_body(FakeExchange([]), 5) == b""


async def test_a_declared_length_past_the_limit_is_refused_before_any_read() -> None:
    exchange = FakeExchange([b"abc"], content_length=6)
    with pytest.raises(BadRequest) as refused:
        await read_body(exchange, 5)
    assert refused.value.status == 413
    assert exchange.reads == 0  # a waiting client gets no `100 Continue`


async def test_a_body_sent_past_the_limit_is_refused_at_the_chunk_that_crosses_it() -> None:
    exchange = FakeExchange([b"abc", b"def", b"never read"])
    with pytest.raises(BadRequest) as refused:
        await read_body(exchange, 5)
    assert refused.value.status == 413
    assert exchange.reads == 2
