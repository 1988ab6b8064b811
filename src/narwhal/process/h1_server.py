"""A worker's HTTP/1.1 server on asyncio protocols, parsed by httptools (llhttp).

Why: with the engine legs on protocols (`engine/h1.py`), aiohttp's server was the largest
piece of a request's CPU left that Narwhal can remove (docs/design/raw-server.md). It serves
what a data-plane worker answers, and no more: exact paths, each with its methods, and a
fallback (the worker forwards it to the control process). Requests on one connection are
served one at a time, in order (pipelining allowed); a request's handler starts when its head
is in, and reads its body as it arrives.

Each connection is an `h1_connection.ServerConnection`, the I/O shell around
`h1_state.Connection`, the connection's state machine; it hands each request to `dispatch`
as an `h1_request.ServerRequest` (which sees its connection only as an
`h1_request.RequestConnection`). The state machine decides every limit
(docs/edge.md, "Limits"): the head's size (431) and time (408), the body's size whatever its
framing (413, before any handler for a declared size) and the time between two of its reads
(408), the idle keep-alive time. A refusal is answered in the OpenAI error shape whatever the
path (the head may not even have one), counted by reason, and followed by a close.
`Expect: 100-continue` is answered when the handler first reads the body, so only once the
head's size and the handler's own checks (the client key) have passed. Connections past the
router's bound (`ConnectionBudget`) are closed as soon as they are accepted.

A client that disconnects cancels its running handler (aiohttp's `handler_cancellation`); a
stream waits for the client to take what was written (`pause_writing`), and a body the
handler leaves unread makes the connection close after the answer. The shell's one limit of
its own: a client whose socket stays full, taking nothing for `send_timeout_s`
(`serving.client_send_timeout_s`), is aborted and counted `send_timeout`. `drain()` stops accepting,
closes idle connections, lets running handlers finish within a grace, then aborts the rest.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import replace
from email.utils import formatdate
from ssl import SSLContext
from typing import Protocol

from narwhal.config import ServingConfig
from narwhal.dataplane.errors import error_body
from narwhal.process import h1_state
from narwhal.process.h1_connection import ServerConnection
from narwhal.process.h1_listen import Listener, bind
from narwhal.process.h1_request import ServerRequest as ServerRequest  # the handlers' type
from narwhal.process.h1_state import Limits

KEEPALIVE_S = h1_state.KEEPALIVE_S
# After an answer given before its request's body had all arrived (a 401, say), the rest of
# the body is read and dropped for up to this long before the connection closes, so the
# client can finish sending and read the answer (aiohttp's lingering_time).
LINGER_S = h1_state.LINGER_S
# Connections the kernel queues before this worker accepts them (capped by somaxconn): with
# asyncio's default of 100, a burst of 256 new clients overflowed it and the dropped SYNs were
# retried a second later (measured: p99 1.1 s in the router-bound bench at c=256). 4096, the
# kernel's default somaxconn: with 1024 a crowd of 2,200 new clients overflowed a worker's
# queue on a loaded machine, and the clients dropped there were refused where the router
# could neither see nor count them (the hostile suite's connection bound).
BACKLOG = 4096
MAX_HEAD_BYTES = h1_state.MAX_HEAD_BYTES

Handler = Callable[["ServerRequest"], Awaitable[None]]


class ConnectionBudget(Protocol):
    """The router's bound on client connections (`serving.max_client_connections`): one
    process's count, or its workers' sum in the shared table."""

    def take(self) -> bool: ...

    def give_back(self) -> None: ...


class LocalConnections:
    """The bound within one process."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.count = 0

    def take(self) -> bool:
        if self.count >= self.limit:
            return False
        self.count += 1
        return True

    def give_back(self) -> None:
        self.count -= 1


def _ignore(reason: str) -> None:
    pass


def client_limits(serving: ServingConfig) -> Limits:
    """The server's limits from the `serving` section (DESIGN §12)."""
    return Limits(
        max_body_bytes=serving.max_body_bytes,
        header_timeout_s=serving.client_header_timeout_s,
        body_timeout_s=serving.client_body_timeout_s,
        send_timeout_s=serving.client_send_timeout_s,
    )


class _Date:
    """The `Date` header, formatted once a second."""

    def __init__(self) -> None:
        self._second = 0
        self._value = b""

    def __call__(self) -> bytes:
        now = int(time.time())
        if now != self._second:
            self._second = now
            self._value = formatdate(now, usegmt=True).encode()
        return self._value


class H1Server:
    """Routes by exact path; `fallback` answers every other path."""

    def __init__(
        self,
        routes: Mapping[str, Mapping[str, Handler]],
        fallback: Handler,
        keepalive_s: float = KEEPALIVE_S,
        linger_s: float = LINGER_S,
        *,
        limits: Limits | None = None,
        budget: ConnectionBudget | None = None,
        on_reject: Callable[[str], None] = _ignore,
    ) -> None:
        """`limits` (the `serving.client_*` keys; its own `keepalive_s` and `linger_s` are
        replaced by the arguments); `budget`, the router's bound on connections (none: no
        bound); `on_reject(reason)` counts each refusal."""
        self.loop = asyncio.get_running_loop()
        self._routes = routes
        self._fallback = fallback
        self.limits = replace(limits or Limits(), keepalive_s=keepalive_s, linger_s=linger_s)
        self.budget: ConnectionBudget = budget or LocalConnections(2**62)
        self.on_reject = on_reject
        self.connections: set[ServerConnection] = set()
        self.draining = False
        self.date = _Date()
        self._listener: Listener | None = None
        self._drained: asyncio.Event | None = None

    @property
    def port(self) -> int:
        """The bound port (after `start`)."""
        assert self._listener is not None, "start() first"
        port: int = self._listener.sockets[0].getsockname()[1]
        return port

    def settled(self) -> None:
        """A connection finished a request or closed: while draining, maybe the last one.
        Draining is over when every connection has closed, which a connection does after
        its last answer has gone out (`transport.close` sends what is buffered first)."""
        if self._drained is not None and not self.connections:
            self._drained.set()

    async def dispatch(self, request: ServerRequest) -> None:
        methods = self._routes.get(request.path)
        if methods is None:
            await self._fallback(request)
            return
        handler = methods.get(request.method) or (
            methods.get("GET") if request.method == "HEAD" else None
        )
        if handler is None:
            allow = ", ".join(sorted({*methods, *(["HEAD"] if "GET" in methods else [])}))
            message = f"Method Not Allowed: {request.method} {request.path}"
            request.respond(
                405,
                error_body(message, "invalid_request_error", 405),
                "application/json",
                {"Allow": allow},
            )
            return
        await handler(request)

    async def start(
        self, host: str, port: int, ssl: SSLContext | None = None, *, reuse_port: bool = True
    ) -> None:
        """Listen (HTTPS with `ssl`: the handshake is asyncio's, before any request).
        `reuse_port`: the workers share the port; one process must not share it with a
        second router by mistake."""
        sockets = await bind(self.loop, host, port, BACKLOG, reuse_port)
        self._listener = Listener(
            self.loop,
            sockets,
            lambda: ServerConnection(self),
            BACKLOG,
            ssl,
            # The handshake is part of the head's time (a TLS slowloris).
            handshake_timeout_s=self.limits.header_timeout_s,
        )

    async def drain(self, grace_s: float) -> None:
        """Stop accepting; close idle connections at once and the others after their
        running request; past `grace_s`, abort what is left."""
        self.draining = True
        self._drained = asyncio.Event()
        if self._listener is not None:
            self._listener.close()
        for c in list(self.connections):
            if c._task is None:
                c.close()
        self.settled()
        try:
            async with asyncio.timeout(grace_s):
                await self._drained.wait()
        except TimeoutError:
            pass
        for c in list(self.connections):
            c.abort()
