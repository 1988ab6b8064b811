"""The HTTP listening socket, closable and reopenable on the same port (refuse_connections)."""

from __future__ import annotations

from aiohttp import web


class HttpListener:
    def __init__(self, runner: web.AppRunner, host: str, port: int) -> None:
        self._runner = runner
        self._host = host
        self._port = port
        self._site: web.TCPSite | None = None

    @property
    def port(self) -> int:
        return self._port

    @property
    def is_open(self) -> bool:
        return self._site is not None

    async def open(self) -> int:
        """Listen (again) on the port; an ephemeral port is fixed by the first open."""
        if self._site is None:
            site = web.TCPSite(self._runner, self._host, self._port, reuse_address=True)
            await site.start()
            self._site = site
            self._port = site.port
        return self._port

    async def close(self) -> None:
        """Stop accepting (new connections are refused) and close idle keep-alive connections.

        Requests in flight finish; their connections close after the response.
        """
        if self._site is not None:
            site, self._site = self._site, None
            await site.stop()
        server = self._runner.server
        if server is not None:
            for handler in server.connections:
                handler.close()
