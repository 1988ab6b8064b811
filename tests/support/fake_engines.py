"""Engines for unit tests of the request path's pieces: a fleet built from engine entries
(verified, as a serving fleet is) and a fake `EngineClient.post` that answers from a script
and keeps what it was sent."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from narwhal.clock import FakeClock
from narwhal.config import Config, parse_config
from narwhal.engine.transport import PoolKind, Reply
from narwhal.fleet.store import Fleet
from tests.support.fleet import verify_all


def fleet_config(*engines: dict[str, Any], **sections: Any) -> Config:
    """A config of `engines` (`id` and `role`, plus any engine keys) for model `m`."""
    entries = [
        {"url": f"http://127.0.0.1:{9001 + i}", **engine} for i, engine in enumerate(engines)
    ]
    return parse_config({"model": "m", "engines": entries, **sections})


def serving_fleet(config: Config, clock: FakeClock) -> Fleet:
    return verify_all(Fleet(config.engines, clock))


@dataclass(frozen=True)
class Sent:
    url: str
    body: bytes
    headers: dict[str, Any]
    timeout_s: float


class FakePost:
    """`post` answers with `answer(url, body)`: a `Reply`, or an exception to raise."""

    def __init__(self, answer: Callable[[str, bytes], Reply | Exception]) -> None:
        self._answer = answer
        self.sent: list[Sent] = []

    async def post(
        self, pool: PoolKind, url: str, body: bytes, headers: Mapping[str, str], timeout_s: float
    ) -> Reply:
        assert pool is PoolKind.DATA
        self.sent.append(Sent(url, body, dict(headers), timeout_s))
        reply = self._answer(url, body)
        if isinstance(reply, Exception):
            raise reply
        return reply
