"""The admin API's fleet changes (DESIGN §10): `POST /admin/engines` adds an engine,
`DELETE /admin/engines/{id}` removes one (`?force=true`: forgotten at once), and `POST
/admin/reload` re-reads the config file."""

from __future__ import annotations

from typing import TYPE_CHECKING

import orjson
from aiohttp import web

from narwhal.config import ConfigError, parse_engine
from narwhal.control.membership import MembershipConflict
from narwhal.http_errors import openai_error

if TYPE_CHECKING:
    from narwhal.server import Router


def add_membership_routes(app: web.Application, router: Router) -> None:
    def refusal() -> web.Response | None:
        """A standby's change would be overwritten by the next handoff it follows."""
        why = router.ownership.operator_refusal() if router.ownership is not None else None
        return None if why is None else openai_error(409, why, "conflict_error")

    async def add_engine(request: web.Request) -> web.StreamResponse:
        refused = refusal()
        if refused is not None:
            return refused
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError as exc:
            return openai_error(400, f"body is not valid JSON: {exc}", "invalid_request_error")
        try:
            config = parse_engine(body)
        except ConfigError as exc:
            key = exc.problems[0].split(":", 1)[0]
            return openai_error(400, str(exc), "invalid_request_error", param=key)
        try:
            router.membership.add(config, "operator")
        except MembershipConflict as exc:
            return openai_error(409, str(exc), "conflict_error")
        state = router.fleet.get(config.id).status(router.clock.monotonic())
        return web.json_response(
            {"engine": config.id, "change": "added", "state": state}, status=201
        )

    async def remove_engine(request: web.Request) -> web.StreamResponse:
        refused = refusal()
        if refused is not None:
            return refused
        engine_id = request.match_info["engine_id"]
        force = request.query.get("force", "false").lower()
        if force not in ("true", "false", "1", "0"):
            return openai_error(
                400, "force must be true or false", "invalid_request_error", param="force"
            )
        if not router.fleet.has(engine_id):
            return openai_error(404, f"no engine {engine_id!r}", "not_found_error")
        in_flight = router.fleet.in_flight.of(engine_id)
        if router.membership.remove(engine_id, "operator", force=force in ("true", "1")):
            return web.json_response({"engine": engine_id, "change": "removed"})
        return web.json_response(
            {"engine": engine_id, "change": "removing", "in_flight": in_flight}, status=202
        )

    async def reload(request: web.Request) -> web.StreamResponse:
        try:
            answer = await router.reload()
        except ConfigError as exc:
            key = exc.problems[0].split(":", 1)[0]
            return openai_error(
                400, f"reload refused, nothing changed: {exc}", "invalid_request_error", param=key
            )
        except MembershipConflict as exc:
            return openai_error(409, f"reload refused, nothing changed: {exc}", "conflict_error")
        return web.json_response(answer)

    app.router.add_post("/admin/reload", reload)
    app.router.add_post("/admin/engines", add_engine)
    app.router.add_delete("/admin/engines/{engine_id}", remove_engine)
