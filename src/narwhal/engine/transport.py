"""HTTP to engines over two bounded pools, with every transport error classified here.

The data pool serves prefill, decode and token counting, on `h1.H1Client` (asyncio protocols
and httptools: the hot path); the control pool (health, probes, readmission) is a separate
aiohttp connector so data traffic can never starve it. Each pool's bound counts every open
socket, idle keep-alive ones included (`H1Client`, `BoundedConnector`). A control
request has one deadline for waiting for a free control connection and for the request: a wait
that uses it up, or leaves the engine too little of it, is never charged to the engine
(`ControlPoolBusy`).
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol

import aiohttp

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
    """Map a transport exception to the spec's failure classes."""
    if isinstance(exc, EngineFailure):
        return exc
    if isinstance(exc, TimeoutError | asyncio.TimeoutError):
        return EngineFailure(timeout_class, "deadline exceeded", timed_out=True)
    if isinstance(exc, EngineConnectFailed):
        return EngineFailure(FailureClass.CONNECTION, str(exc))
    if isinstance(exc, EngineConnectionLost | EngineProtocolError):
        return EngineFailure(FailureClass.CONNECTION, f"connection lost: {exc}")
    if isinstance(exc, aiohttp.ClientConnectorError):
        return EngineFailure(FailureClass.CONNECTION, f"connect failed: {exc.os_error}")
    if isinstance(exc, aiohttp.ClientPayloadError | aiohttp.ServerDisconnectedError):
        return EngineFailure(FailureClass.CONNECTION, f"connection lost: {exc}")
    if isinstance(exc, aiohttp.ClientError | OSError):
        return EngineFailure(FailureClass.CONNECTION, f"{type(exc).__name__}: {exc}")
    raise exc


class BoundedConnector(aiohttp.TCPConnector):
    """A connector whose `limit` bounds open sockets, idle keep-alive ones included.

    aiohttp's `limit` counts only connections in use, so a router at its bound could also
    hold as many idle keep-alive sockets (measured: 4 decodes streaming plus 4 idle prefill
    sockets with `max_connections: 4`). Reusing an idle socket or releasing one into the idle
    pool leaves the number of open sockets unchanged; only opening a new one raises it, so
    the bound is kept there: before a new socket is opened, the oldest idle sockets (of any
    engine) are closed until in use + idle + the new one fit the limit. The hot path, reuse
    of an idle socket, is untouched.

    This relies on aiohttp's private `_create_connection` hook, `_acquired` (in-use
    connections, including the placeholder of the one being opened) and `_conns` (idle
    connections per key, oldest first), pinned to aiohttp 3.14 in pyproject.toml;
    tests/e2e/test_dataplane_pools.py counts the real sockets and fails if they change.
    """

    async def _create_connection(self, req: Any, traces: Any, client_timeout: Any) -> Any:
        if self._evict_idle():
            # asyncio closes a transport's socket on the next loop iteration: let it, so
            # that the old socket is gone before the new one exists.
            await asyncio.sleep(0)
        return await super()._create_connection(req, traces, client_timeout)

    def _evict_idle(self) -> bool:
        """Close the oldest idle sockets until one more fits the limit; True if any was."""
        limit = self._limit
        if not limit:
            return False
        idle = self._conns
        excess = len(self._acquired) + sum(len(q) for q in idle.values()) - limit
        evicted = False
        while excess > 0 and idle:
            key = min(idle, key=lambda k: idle[k][0][1])  # the oldest idle socket
            protocol, _ = idle[key].popleft()
            if not idle[key]:
                del idle[key]
            protocol.close()
            excess -= 1
            evicted = True
        return evicted


def _connector(limit: int, ssl_context: ssl.SSLContext | None) -> aiohttp.TCPConnector:
    return BoundedConnector(
        ssl=ssl_context if ssl_context is not None else True,
        limit=limit,
        limit_per_host=0,
        keepalive_timeout=30,
        enable_cleanup_closed=False,
        family=socket.AF_UNSPEC,
    )


class EngineClient:
    """Owns the two pools' clients; created and closed inside the running loop."""

    def __init__(
        self,
        data_limit: int,
        control_limit: int,
        ssl_context: ssl.SSLContext | None = None,
        data_sockets: SocketBudget | None = None,
    ) -> None:
        """`ssl_context`: how HTTPS engines are verified (default: the system trust store,
        which honours SSL_CERT_FILE). `data_sockets`: the data pool's open sockets as shared
        with the other data-plane workers."""
        self._data_limit = data_limit
        self._control_limit = control_limit
        self._ssl = ssl_context
        self._data_sockets = data_sockets
        self._data: H1Client | None = None
        self._sessions: dict[PoolKind, aiohttp.ClientSession] = {}
        self._control = asyncio.Semaphore(control_limit)
        self.control_in_use = 0

    async def start(self) -> None:
        self._data = H1Client(self._data_limit, self._ssl, shared=self._data_sockets)
        self._sessions[PoolKind.CONTROL] = aiohttp.ClientSession(
            connector=_connector(self._control_limit, self._ssl),
            timeout=aiohttp.ClientTimeout(total=None),
            auto_decompress=False,
            skip_auto_headers=("User-Agent",),
            # The router relays engine bytes as they are (SSE) and parses handoffs: a
            # compressed answer would break both, so engines are asked not to compress.
            headers={"Accept-Encoding": "identity"},
            cookie_jar=aiohttp.DummyCookieJar(),  # engines' cookies are never sent back
        )

    async def close(self) -> None:
        if self._data is not None:
            self._data.close()
            self._data = None
        for session in self._sessions.values():
            await session.close()
        self._sessions.clear()

    def session(self, pool: PoolKind) -> aiohttp.ClientSession:
        """The control pool's aiohttp session (the data pool has none)."""
        assert pool is PoolKind.CONTROL, "the data pool is H1Client's: use stream() or post()"
        return self._sessions[pool]

    async def stream(self, url: str, body: bytes, headers: Mapping[str, str]) -> EngineResponse:
        """A data-pool POST whose answer is read as it arrives; the caller bounds the time,
        ends the response (`release` or `close`) and classifies `OSError`s."""
        assert self._data is not None, "EngineClient.start() first"
        return await self._data.request("POST", url, body, headers)

    async def _data_request(
        self, method: str, url: str, body: bytes, headers: Mapping[str, str]
    ) -> Reply:
        assert self._data is not None, "EngineClient.start() first"
        resp = await self._data.request(method, url, body, headers)
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
            if pool is PoolKind.DATA:
                async with asyncio.timeout(timeout_s):
                    return await self._data_request("POST", url, body, headers)
            async with (
                self.deadline(pool, timeout_s),
                self._sessions[pool].post(url, data=body, headers=headers) as resp,
            ):
                data = await resp.read()
                return Reply(resp.status, data, resp.content_type)
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise classify_exception(exc, timeout_class) from None

    async def get(
        self,
        pool: PoolKind,
        url: str,
        timeout_s: float,
        headers: Mapping[str, str] | None = None,
    ) -> Reply:
        try:
            if pool is PoolKind.DATA:
                async with asyncio.timeout(timeout_s):
                    return await self._data_request("GET", url, b"", headers or {})
            async with (
                self.deadline(pool, timeout_s),
                self._sessions[pool].get(url, headers=headers) as resp,
            ):
                data = await resp.read()
                return Reply(resp.status, data, resp.content_type)
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
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
