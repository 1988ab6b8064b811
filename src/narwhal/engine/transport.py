"""HTTP to engines over two bounded pools, with every transport error classified here.

Both pools run on `h1.H1Client` (asyncio protocols and httptools), one instance each with its
own bound on open sockets, idle keep-alive ones included: the data pool serves prefill, decode
and token counting; the control pool serves health checks, probes, readmission and the
adapters' scrapes, and data traffic can never starve it. A control request has one deadline
for waiting for a free control connection and for the request: a wait that uses it up, or
leaves the engine too little of it, is never charged to the engine (`ControlPoolBusy`).
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol

from narwhal.engine.failures import EngineFailure, FailureClass
from narwhal.engine.h1 import (
    EngineConnectFailed,
    EngineConnectionLost,
    EngineProtocolError,
    EngineResponse,
    H1Client,
    SocketBudget,
)


class PoolKind(StrEnum):
    DATA = "data"
    CONTROL = "control"


@dataclass(frozen=True, slots=True)
class Reply:
    status: int
    body: bytes
    content_type: str


class ControlPoolBusy(EngineFailure):
    """No control connection came free in time, so the engine was never asked: no evidence
    against it. A subclass of EngineFailure so that code which does not judge engines handles
    it as any failed request; health checks and probes, which do judge them, tell it apart."""

    def __init__(self, waited_s: float) -> None:
        detail = f"no control connection free within {waited_s:g} s"
        super().__init__(FailureClass.TIMEOUT, detail, timed_out=True)


def classify_exception(exc: BaseException, timeout_class: FailureClass) -> EngineFailure:
    """Map a transport exception to the spec's failure classes (docs/failure-handling.md):
    a deadline to `timeout_class`, anything the socket or the engine's bytes did to
    `connection`. `H1Client` raises `OSError`s only (its own are `ConnectionError`s; a TLS
    error is an `ssl.SSLError`); anything else is not a transport error and propagates."""
    if isinstance(exc, EngineFailure):
        return exc
    if isinstance(exc, TimeoutError):
        return EngineFailure(timeout_class, "deadline exceeded", timed_out=True)
    if isinstance(exc, EngineConnectFailed):
        return EngineFailure(FailureClass.CONNECTION, str(exc))
    if isinstance(exc, EngineConnectionLost | EngineProtocolError):
        return EngineFailure(FailureClass.CONNECTION, f"connection lost: {exc}")
    if isinstance(exc, OSError):
        return EngineFailure(FailureClass.CONNECTION, f"{type(exc).__name__}: {exc}")
    raise exc


class EngineClient:
    """Owns the two pools' clients; created and closed inside the running loop."""

    def __init__(
        self,
        data_limit: int,
        control_limit: int,
        ssl_context: ssl.SSLContext | None = None,
        data_sockets: SocketBudget | None = None,
    ) -> None:
        """`ssl_context`: how HTTPS engines are verified, on both pools (default: the system
        trust store, which honours SSL_CERT_FILE). `data_sockets`: the data pool's open
        sockets as shared with the other data-plane workers (the control pool is the
        control process's alone)."""
        self._data_limit = data_limit
        self._control_limit = control_limit
        self._ssl = ssl_context
        self._data_sockets = data_sockets
        self._data: H1Client | None = None
        self._control_client: H1Client | None = None
        # Requests holding a control connection. The control client's socket bound alone
        # would keep sockets bounded too; this gate makes a wait measurable, so that it is
        # never charged to an engine (`deadline`), and lets a non-HTTP control step (a TLS
        # attestation) hold a slot.
        self._control = asyncio.Semaphore(control_limit)
        self.control_in_use = 0

    async def start(self) -> None:
        self._data = H1Client(self._data_limit, self._ssl, shared=self._data_sockets)
        self._control_client = H1Client(self._control_limit, self._ssl)

    async def close(self) -> None:
        for client in (self._data, self._control_client):
            if client is not None:
                client.close()
        self._data = self._control_client = None

    def _client(self, pool: PoolKind) -> H1Client:
        client = self._data if pool is PoolKind.DATA else self._control_client
        assert client is not None, "EngineClient.start() first"
        return client

    async def stream(
        self,
        url: str,
        body: bytes,
        headers: Mapping[str, str],
        pool: PoolKind = PoolKind.DATA,
    ) -> EngineResponse:
        """A POST whose answer is read as it arrives; the caller bounds the time, ends the
        response (`release` or `close`) and classifies `OSError`s. On the control pool, call
        it inside `deadline(PoolKind.CONTROL, ...)`, which holds the control connection."""
        return await self._client(pool).request("POST", url, body, headers)

    async def _request(
        self, pool: PoolKind, method: str, url: str, body: bytes, headers: Mapping[str, str]
    ) -> Reply:
        resp = await self._client(pool).request(method, url, body, headers)
        try:
            data = await resp.read()
        finally:
            resp.release()  # reused when read whole; closed when cut short
        return Reply(resp.status, data, resp.content_type)

    @asynccontextmanager
    async def control_slot(self, wait_s: float) -> AsyncIterator[None]:
        """Hold one control connection for a request; ControlPoolBusy after `wait_s`."""
        try:
            async with asyncio.timeout(wait_s):
                await self._control.acquire()
        except TimeoutError:
            raise ControlPoolBusy(wait_s) from None
        self.control_in_use += 1
        try:
            yield
        finally:
            self.control_in_use -= 1
            self._control.release()

    @asynccontextmanager
    async def deadline(self, pool: PoolKind, timeout_s: float) -> AsyncIterator[None]:
        """One deadline of `timeout_s` for a whole control-pool request, waiting for a free
        control connection included (the data pool's requests are bounded by their callers,
        and its gate is the data plane's own, `dataplane/pool.py`).

        A control request that times out after queueing for more than half its timeout is
        `ControlPoolBusy`, not the engine's timeout: the engine was given too little of the
        deadline to judge it (frozen engines holding every control connection must not make
        the healthy ones queued behind them look silent)."""
        assert pool is PoolKind.CONTROL, "the data pool has no control slots"
        started = time.monotonic()
        async with self.control_slot(timeout_s):
            waited_s = time.monotonic() - started
            try:
                async with asyncio.timeout(timeout_s - waited_s):
                    yield
            except TimeoutError:
                if waited_s > timeout_s / 2:
                    raise ControlPoolBusy(waited_s) from None
                raise

    async def _bounded(
        self,
        pool: PoolKind,
        method: str,
        url: str,
        body: bytes,
        headers: Mapping[str, str],
        timeout_s: float,
    ) -> Reply:
        if pool is PoolKind.DATA:
            async with asyncio.timeout(timeout_s):
                return await self._request(pool, method, url, body, headers)
        async with self.deadline(pool, timeout_s):
            return await self._request(pool, method, url, body, headers)

    async def post(
        self,
        pool: PoolKind,
        url: str,
        body: bytes,
        headers: Mapping[str, str],
        timeout_s: float,
        timeout_class: FailureClass = FailureClass.TIMEOUT,
    ) -> Reply:
        """POST and read the whole reply; raises EngineFailure on transport trouble."""
        try:
            if pool is PoolKind.DATA:  # every leg's path: no control slot, one frame fewer
                async with asyncio.timeout(timeout_s):
                    return await self._request(pool, "POST", url, body, headers)
            return await self._bounded(pool, "POST", url, body, headers, timeout_s)
        except (TimeoutError, OSError) as exc:
            raise classify_exception(exc, timeout_class) from None

    async def get(
        self,
        pool: PoolKind,
        url: str,
        timeout_s: float,
        headers: Mapping[str, str] | None = None,
    ) -> Reply:
        try:
            return await self._bounded(pool, "GET", url, b"", headers or {}, timeout_s)
        except (TimeoutError, OSError) as exc:
            raise classify_exception(exc, FailureClass.TIMEOUT) from None


class _Engine(Protocol):
    @property
    def url(self) -> str: ...

    def resolved_api_key(self) -> str | None: ...


async def control_get(client: EngineClient, engine: _Engine, path: str, timeout_s: float) -> Reply:
    """A GET on the control pool with the engine's API key (health, identity, metrics)."""
    headers = engine_headers(engine.resolved_api_key(), None)
    return await client.get(PoolKind.CONTROL, engine.url + path, timeout_s, headers=headers)


def engine_headers(
    api_key: str | None, request_id: str | None, trace: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """A leg's headers: the engine's own key (never the client's), the attempt's id, and the
    client's trace context (`traceparent`, `tracestate`) unchanged."""
    headers: dict[str, Any] = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    if request_id:
        headers["X-Request-Id"] = request_id
    if trace:
        headers.update(trace)
    return headers
