"""The client server's way to the admin surface: `/metrics`, `/admin/*`, the dashboard and
unknown paths, forwarded to the control process's aiohttp app on its Unix socket (a private
0700 directory), in every process mode.

An `/admin` request without the admin token is refused here, before a declared body is read
(so before any `100 Continue`); a chunked one is read first, as far as `serving.max_body_bytes`,
since the size is checked before the key (DESIGN §12). The control process checks the token
again. The body was already bounded by the server.
"""

from __future__ import annotations

import hmac
from typing import TYPE_CHECKING

from narwhal.dataplane.body import size_before_key
from narwhal.dataplane.errors import error_answer, error_body
from narwhal.dataplane.exchange import Answer
from narwhal.process.gate import CONTROL_LOST
from narwhal.process.h1_server import ServerRequest

if TYPE_CHECKING:
    import aiohttp

NDJSON = "application/x-ndjson"


class ControlForward:
    def __init__(self, socket_path: str, admin_token: str | None, max_body_bytes: int) -> None:
        """`admin_token`: resolved once, as the control process's admin app does."""
        self._path = socket_path
        self._token = admin_token
        self._max_body_bytes = max_body_bytes
        self._session: aiohttp.ClientSession | None = None

    def _denied(self, request: ServerRequest) -> bool:
        path = request.path
        if path != "/admin" and not path.startswith("/admin/"):
            return False
        token = self._token
        if token is None:
            return False
        given = request.header("authorization") or ""
        return not hmac.compare_digest(given.encode(), f"Bearer {token}".encode())

    async def __call__(self, request: ServerRequest) -> None:
        # Imported at the first forward: a worker's start does not pay for aiohttp (about
        # 0.1 s of its imports) to serve the data plane, which never uses it.
        import aiohttp

        if self._denied(request):
            body = error_body("missing or wrong admin token", "unauthorized", 401)
            headers = {"WWW-Authenticate": 'Bearer realm="narwhal-admin"'}
            refusal = Answer(401, body, "application/json", "unauthorized", headers)
            request.answer(await size_before_key(request, self._max_body_bytes, refusal))
            return
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.UnixConnector(path=self._path, limit=8),
                auto_decompress=False,
            )
        body = await request.read()
        headers = {
            k: v
            for k in ("Authorization", "Content-Type", "Accept")
            if (v := request.headers.get(k.lower())) is not None
        }
        try:
            async with self._session.request(
                request.method, "http://control" + request.path_qs, data=body, headers=headers
            ) as answer:
                content_type = answer.headers.get("Content-Type", "")
                if answer.status == 200 and content_type.startswith(NDJSON):
                    # A progress stream (`narwhal readmit`): passed on as it comes.
                    await request.start_stream({}, NDJSON)
                    async for piece in answer.content.iter_any():
                        await request.send(piece)
                    await request.end()
                    return
                payload = await answer.read()
                out = {
                    k: v
                    for k in ("WWW-Authenticate", "Retry-After", "Allow")
                    if (v := answer.headers.get(k)) is not None
                }
                content_type = answer.headers.get("Content-Type", "application/octet-stream")
                request.respond(answer.status, payload, content_type, out)
        except (aiohttp.ClientError, OSError):
            request.answer(
                error_answer(
                    503, CONTROL_LOST, "service_unavailable", "control_lost", retry_after_s=1
                )
            )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
