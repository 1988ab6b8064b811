"""The router's admin surface on aiohttp, in the control process in every mode: `/metrics`,
the admin API (`/admin/*`) and the dashboard. The client API is `process/routes.py`, on the
HTTP/1.1 server, which forwards these paths here over a Unix socket (DESIGN §12).

`add_admin_routes` puts the admin token in front of every `/admin` path, then lets each
surface add its own routes: `add_metrics_routes`, `add_admin_api_routes` (the views, the
operator's actions, the fleet's membership) and `add_dashboard_routes`.
"""

from __future__ import annotations

import asyncio
import hmac
import os
from collections.abc import Awaitable, Callable
from importlib import resources
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web
from aiohttp.typedefs import Middleware

from narwhal.http_errors import openai_error
from narwhal.http_membership import add_membership_routes
from narwhal.state.handoff import newest
from narwhal.telemetry import admin_views

if TYPE_CHECKING:
    from narwhal.server import Router

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def add_admin_routes(app: web.Application, router: Router) -> None:
    """Every route of the control process's app."""
    token = router.config.admin.resolve_token()
    app.middlewares.append(_admin_auth(token))
    add_metrics_routes(app, router, token)
    add_admin_api_routes(app, router)
    add_dashboard_routes(app, router)


def _is_bearer(given: str | None, token: str | None) -> bool:
    """`given` (an `Authorization` value) carries the admin token, compared in constant time."""
    return (
        token is not None
        and given is not None
        and hmac.compare_digest(given.encode(), f"Bearer {token}".encode())
    )


def _admin_auth(token: str | None) -> Middleware:
    @web.middleware
    async def admin_auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        """Every `/admin` path needs the token before anything else is decided (404, 405,
        400): an unauthenticated caller learns nothing and changes nothing."""
        path = request.path
        if (
            token is not None
            and (path == "/admin" or path.startswith("/admin/"))
            and not _is_bearer(request.headers.get("Authorization", ""), token)
        ):
            denied = openai_error(401, "missing or wrong admin token", "unauthorized")
            denied.headers["WWW-Authenticate"] = 'Bearer realm="narwhal-admin"'
            return denied
        return await handler(request)

    return admin_auth


# ---------------------------------------------------------------------- metrics
def add_metrics_routes(app: web.Application, router: Router, token: str | None) -> None:
    """`/metrics`: with `auth.protect_metrics`, a client key or the admin token."""
    dataplane = router.dataplane

    async def metrics(request: web.Request) -> web.StreamResponse:
        if router.config.auth.protect_metrics:
            given = request.headers.get("Authorization")
            refused, _ = dataplane.authenticate(given)
            if refused is not None and not _is_bearer(given, token):
                return web.Response(
                    status=refused.status,
                    body=refused.body,
                    content_type=refused.content_type,
                    headers=refused.headers,
                )
        router.ready()
        router.metrics.admitting.set(1 if router.admission.admitting else 0)
        body = router.metrics.render()
        return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4"})

    app.router.add_get("/metrics", metrics)


# ---------------------------------------------------------------------- admin API
def add_admin_api_routes(app: web.Application, router: Router) -> None:
    """`/admin/*` but the dashboard's document: what the router sees, what the operator
    does to an engine, and the fleet's membership (`http_membership`)."""
    _add_admin_views(app, router)
    add_membership_routes(app, router)
    _add_operator_actions(app, router)


def _add_admin_views(app: web.Application, router: Router) -> None:
    """What the router sees, read-only: each view a pure function of a snapshot
    (`admin_views`)."""

    async def admin_events(request: web.Request) -> web.StreamResponse:
        try:
            after = int(request.query.get("after", "0"))
        except ValueError:
            return openai_error(
                400, "after must be an integer", "invalid_request_error", param="after"
            )
        events = router.events.after(after)
        last = events[-1].seq if events else after
        return web.json_response({"events": [e.to_json() for e in events], "last": last})

    async def admin_engines(request: web.Request) -> web.StreamResponse:
        return web.json_response(admin_views.engines_document(router.admin_snapshot()))

    async def admin_monitor(request: web.Request) -> web.StreamResponse:
        return web.json_response(router.monitor.to_json())

    async def admin_handoff(request: web.Request) -> web.StreamResponse:
        verdict = router.resume_verdict
        followed = router.ownership.followed if router.ownership is not None else None
        return web.json_response(
            admin_views.handoff(
                str(router.handoff.path),
                router.handoff.sequence,
                newest(router.handoff.last_document, followed),
                None if verdict is None else (verdict.ok, verdict.reason, verdict.code),
            )
        )

    async def admin_lease(request: web.Request) -> web.StreamResponse:
        held = router.ownership.to_json() if router.ownership is not None else None
        router_id = router.config.effective_router_id
        return web.json_response(admin_views.lease(held, router_id, with_router_id=True))

    async def admin_workers(request: web.Request) -> web.StreamResponse:
        """The data-plane processes: this one alone without workers (DESIGN §9)."""
        sup = router.supervisor
        if sup is None:
            return web.json_response(admin_views.workers(None, os.getpid(), None))
        return web.json_response(admin_views.workers(sup.to_json(), os.getpid(), sup.version))

    async def admin_stats(request: web.Request) -> web.StreamResponse:
        return web.json_response(admin_views.stats(router.stats_snapshot()))

    async def admin_flow(request: web.Request) -> web.StreamResponse:
        return web.json_response(admin_views.flow(router.flow_snapshot()))

    app.router.add_get("/admin/events", admin_events)
    app.router.add_get("/admin/engines", admin_engines)
    app.router.add_get("/admin/monitor", admin_monitor)
    app.router.add_get("/admin/handoff", admin_handoff)
    app.router.add_get("/admin/lease", admin_lease)
    app.router.add_get("/admin/workers", admin_workers)
    app.router.add_get("/admin/stats", admin_stats)
    app.router.add_get("/admin/flow", admin_flow)


def _add_operator_actions(app: web.Application, router: Router) -> None:
    """What the operator does: explain a placement, drain an engine, put it in planned
    maintenance (moving its streams), readmit it (DESIGN §10, docs/readmission.md)."""

    async def placement(request: web.Request) -> web.StreamResponse:
        """How a completions or chat body would be placed now, without running it (DESIGN
        §11), as this process's index sees it."""
        answer = router.dataplane.explain_placement(await request.read())
        return web.Response(
            status=answer.status, body=answer.body, content_type=answer.content_type
        )

    async def drain(request: web.Request) -> web.StreamResponse:
        found = await _operator_request(router, request)
        if isinstance(found, web.Response):
            return found
        engine_id, reason, _ = found
        router.operator.drain(engine_id, reason)
        router.publish()
        return web.json_response({"engine": engine_id, "hold": "operator_drain"})

    async def maintenance(request: web.Request) -> web.StreamResponse:
        found = await _operator_request(router, request, ("migrate",))
        if isinstance(found, web.Response):
            return found
        engine_id, reason, flags = found
        if flags["migrate"] and not router.config.serving.migrations:
            return openai_error(
                409,
                "migrate: streams migrate only under serving.policy bounded with "
                "serving.migration_limit above 0",
                "conflict_error",
                param="migrate",
            )
        await router.operator.maintenance(engine_id, reason)
        router.publish()  # the hold first: a moved stream's next pair avoids this engine
        if flags["migrate"]:
            router.move_streams(engine_id)
        answer = {"engine": engine_id, "hold": "planned_maintenance"}
        return web.json_response({**answer, "migrate": True} if flags["migrate"] else answer)

    async def readmit(request: web.Request) -> web.StreamResponse:
        found = await _operator_request(router, request)
        if isinstance(found, web.Response):
            return found
        engine_id, reason, _ = found
        if "application/x-ndjson" in request.headers.get("Accept", ""):
            return await _readmit_stream(router, request, engine_id, reason)
        steps = await router.operator.readmit(engine_id, reason)
        router.publish()
        ok = all(s["ok"] for s in steps)
        return web.json_response(
            {"engine": engine_id, "readmitted": ok, "steps": steps}, status=200 if ok else 409
        )

    app.router.add_post("/admin/placement", placement)
    app.router.add_post("/admin/engines/{engine_id}/drain", drain)
    app.router.add_post("/admin/engines/{engine_id}/maintenance", maintenance)
    app.router.add_post("/admin/engines/{engine_id}/readmit", readmit)


async def _operator_request(
    router: Router, request: web.Request, flags: tuple[str, ...] = ()
) -> tuple[str, str | None, dict[str, bool]] | web.Response:
    """The engine id (404 if unknown), the optional `reason` of an admin POST body, and
    its boolean `flags` (false when absent).

    No body, or an empty one, is fine; a body must be a JSON object whose `reason`, if
    present, is a string and whose flags are booleans (400 otherwise, before anything
    changes).
    """
    refusal = router.ownership.operator_refusal() if router.ownership is not None else None
    if refusal is not None:  # a standby's change would be overwritten by the next handoff
        return openai_error(409, refusal, "conflict_error")
    engine_id = request.match_info["engine_id"]
    if not router.fleet.has(engine_id):
        return openai_error(404, f"no engine {engine_id!r}", "not_found_error")
    raw = await request.read()
    if not raw.strip():
        return engine_id, None, dict.fromkeys(flags, False)
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        return openai_error(400, f"body is not valid JSON: {exc}", "invalid_request_error")
    if not isinstance(body, dict):
        return openai_error(400, "body must be a JSON object", "invalid_request_error")
    reason = body.get("reason")
    if reason is not None and not isinstance(reason, str):
        return openai_error(400, "reason must be a string", "invalid_request_error", param="reason")
    for flag in flags:
        if not isinstance(body.get(flag, False), bool):
            return openai_error(
                400, f"{flag} must be true or false", "invalid_request_error", param=flag
            )
    return engine_id, reason or None, {flag: body.get(flag, False) for flag in flags}


async def _readmit_stream(
    router: Router, request: web.Request, engine_id: str, reason: str | None
) -> web.StreamResponse:
    """The readmission's steps as NDJSON lines as they happen, then the verdict's line
    (`{"engine", "readmitted", "steps"}`); 200 from the start."""
    lines: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()

    async def run() -> list[dict[str, Any]]:
        try:
            return await router.operator.readmit(engine_id, reason, lines.put_nowait)
        finally:
            lines.put_nowait(None)

    resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
    await resp.prepare(request)
    task = asyncio.ensure_future(run())
    try:
        while (step := await lines.get()) is not None:
            await resp.write(orjson.dumps(step) + b"\n")
        steps = await task
    finally:
        task.cancel()
    router.publish()
    verdict = {"engine": engine_id, "readmitted": all(s["ok"] for s in steps), "steps": steps}
    await resp.write(orjson.dumps(verdict) + b"\n")
    await resp.write_eof()
    return resp


# ---------------------------------------------------------------------- dashboard
def add_dashboard_routes(app: web.Application, router: Router) -> None:
    """`/dashboard`, a static page, and `/admin/dashboard`, the document it polls (behind
    the admin token like every `/admin` path)."""
    page = resources.files("narwhal.telemetry").joinpath("dashboard.html").read_bytes()

    async def dashboard(request: web.Request) -> web.StreamResponse:
        return web.Response(body=page, content_type="text/html")

    async def admin_dashboard(request: web.Request) -> web.StreamResponse:
        return web.json_response(admin_views.dashboard(router.admin_snapshot()))

    app.router.add_get("/dashboard", dashboard)
    app.router.add_get("/admin/dashboard", admin_dashboard)
