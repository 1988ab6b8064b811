"""The HTTP listening socket, closable and reopenable on the same port (refuse_connections)."""

from __future__ import annotations

from aiohttp import web
from aiohttp.web_protocol import RequestHandler


class HttpListener:
    def __init__(self, runner: web.AppRunner, host: str, port: int) -> None:
        self._runner = runner
        self._host = host
        self._port = port
        self._site: web.TCPSite | None = None

    @property
    def port(self) -> int:
        return self._port

    async def open(self) -> int:
        """Listen (again) on the port; an ephemeral port is fixed by the first open."""
        if self._site is None:
            # vLLM's server (uvicorn) listens with a backlog of 2048; aiohttp's default of 128
            # overflows when a router opens a few hundred connections at once, and the kernel
            # drops the SYNs for a second.
            site = web.TCPSite(
                self._runner, self._host, self._port, reuse_address=True, backlog=2048
            )
            await site.start()
            self._site = site
            self._port = site.port
        return self._port

    async def close(self) -> list[RequestHandler]:
        """Stop accepting: new connections are refused at the TCP level.

        Returns the open connections; `handler.close()` then `await handler.shutdown(None)`
        closes one, at once when idle, after its response when a request is in flight.
        """
        if self._site is not None:
            site, self._site = self._site, None
            await site.stop()
        server = self._runner.server
        return server.connections if server is not None else []
