"""OpenAI-shaped answers for the errors aiohttp itself produces on the router's API paths.

aiohttp answers an unknown path (404), a wrong method (405) and an unexpected exception (500)
in plain text; an OpenAI client on `/v1/*` (and an operator tool on `/admin/*`) expects
`{"error": {"message", "type", "param", "code"}}` like every other error the router gives.
`/health`, `/ready` and `/metrics` keep their plain-text answers.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from aiohttp import hdrs, web

from narwhal.dataplane.errors import error_body

log = logging.getLogger("narwhal.http")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_JSON_PREFIXES = ("/v1/", "/admin/")


def openai_error(
    status: int,
    message: str,
    type_: str,
    *,
    param: str | None = None,
    retry_after_s: int | None = None,
) -> web.Response:
    """An OpenAI-shaped error as the admin app's aiohttp answer (the data plane builds its own
    `Answer`s without aiohttp, `dataplane/errors.py`)."""
    headers = {"Retry-After": str(retry_after_s)} if retry_after_s is not None else None
    return web.Response(
        status=status,
        body=error_body(message, type_, status, param),
        content_type="application/json",
        headers=headers,
    )


def _json_path(path: str) -> bool:
    return path.startswith(_JSON_PREFIXES) or path in ("/v1", "/admin")


def _error_type(status: int) -> str:
    if status == 404:
        return "not_found_error"
    return "invalid_request_error" if status < 500 else "server_error"


@web.middleware
async def openai_http_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """The outermost middleware: turns aiohttp's HTTP errors and unexpected exceptions into
    OpenAI-style JSON on API paths; anything else passes through unchanged."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400 or not _json_path(request.path):
            raise
        default = f"{exc.status}: {exc.reason}"
        message = exc.text if exc.text and exc.text != default else None
        message = message or f"{exc.reason}: {request.method} {request.path}"
        response = openai_error(exc.status, message, _error_type(exc.status))
        if allow := exc.headers.get(hdrs.ALLOW):
            response.headers[hdrs.ALLOW] = allow
        return response
    except Exception:
        if not _json_path(request.path):
            raise
        log.exception("unexpected error serving %s %s", request.method, request.path)
        return openai_error(500, "internal server error", "server_error")
