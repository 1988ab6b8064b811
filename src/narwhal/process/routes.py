"""The client API's one route table (DESIGN §12), served by `H1Server` in every process mode.

`/v1/*`, `/tokenize`, `/detokenize`, `/health` and `/ready` are answered by the process that
accepted the connection (a data-plane worker, or the one process with `serving.workers: 1`);
`/metrics`, `/admin/*`, the dashboard and every unknown path go to the admin surface, the
control process's aiohttp app (`http_routes.add_admin_routes`), through `forward`. So the two
modes differ in where these pieces run, not in what code serves a request.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

from narwhal.dataplane.exchange import Answer
from narwhal.dataplane.models import models_list
from narwhal.dataplane.plane import DataPlane, Route
from narwhal.process.h1_server import Handler, ServerRequest


@dataclass(frozen=True)
class ClientSurface:
    """What the client routes need from the process that serves them."""

    dataplane: DataPlane
    ready: Callable[[], str | None]  # None, or why `/ready` is 503
    models: Callable[[], Any]  # the servable models, for `/v1/models`
    forward: Handler  # to the admin surface
    # Headers on `/health` and `/ready` (a worker names itself).
    probe_headers: Mapping[str, str] = field(default_factory=dict)
    # Completions and chat in progress, +1 / -1 (a worker's crash loses these).
    in_progress: Callable[[str, int], None] | None = None


def client_routes(s: ClientSurface) -> dict[str, dict[str, Handler]]:
    dataplane, probe_headers, in_progress = s.dataplane, s.probe_headers, s.in_progress

    def endpoint(name: Route) -> Handler:
        async def handle(request: ServerRequest) -> None:
            if in_progress is not None:
                in_progress(name, 1)
            try:
                result = await dataplane.handle(name, request)
            finally:
                if in_progress is not None:
                    in_progress(name, -1)
            if isinstance(result, Answer):
                request.answer(result)

        return handle

    def passthrough(path: str) -> Handler:
        async def handle(request: ServerRequest) -> None:
            request.answer(await dataplane.passthrough(path, request))

        return handle

    async def health(request: ServerRequest) -> None:
        request.respond(200, b"ok", "text/plain", probe_headers)

    async def ready(request: ServerRequest) -> None:
        reason = s.ready()
        if reason is None:
            request.respond(200, b"ready", "text/plain", probe_headers)
        else:
            request.respond(503, reason.encode(), "text/plain", probe_headers)

    async def models(request: ServerRequest) -> None:
        refused, _ = dataplane.authenticate(request.header("authorization"))
        if refused is not None:
            request.answer(refused)
            return
        request.respond(200, orjson.dumps(models_list(s.models())), "application/json")

    return {
        "/v1/completions": {"POST": endpoint("completions")},
        "/v1/chat/completions": {"POST": endpoint("chat")},
        "/v1/models": {"GET": models},
        "/v1/embeddings": {"POST": endpoint("embeddings")},
        "/tokenize": {"POST": passthrough("/tokenize")},
        "/detokenize": {"POST": passthrough("/detokenize")},
        "/health": {"GET": health},
        "/ready": {"GET": ready},
        "/metrics": {"GET": s.forward},
    }
