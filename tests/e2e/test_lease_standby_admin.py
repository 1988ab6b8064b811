"""Operator actions on a router that does not hold the lease (docs/lease.md), over HTTP.

A standby's (or fenced router's) drain, maintenance or readmit would be overwritten by the
next handoff it follows, so it answers 409 with an OpenAI-style error that starts `standby: `
(or `fenced: `) and names the active, and changes nothing. A standby's `/admin/lease` gives
the record's time left. Real routers on loopback over a real lease file; the other holder
is a record written into that file.
"""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from tests.support.poll import eventually
from tests.support.router import RunningRouter, StartRouter

ENGINES = [
    {"id": "p0", "url": "http://127.0.0.1:9", "role": "prefill"},
    {"id": "d0", "url": "http://127.0.0.1:19", "role": "decode"},
]
ACTIONS = ("drain", "maintenance", "readmit")
HOUR_S = 3600.0


def hold_lease(path: Path, holder: str, epoch: int, ttl_s: float) -> None:
    """Write `holder`'s record under the file store's lock, as another router would: written
    without it, a renewal in flight could overwrite it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"holder": holder, "epoch": epoch, "expires_at": time.time() + ttl_s}
    fd = os.open(path.with_name(path.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        path.write_bytes(orjson.dumps(record))
    finally:
        os.close(fd)  # releases the lock


async def get_json(http: aiohttp.ClientSession, url: str) -> Any:
    async with http.get(url) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def refused_everywhere(
    http: aiohttp.ClientSession, rr: RunningRouter, prefix: str
) -> list[str]:
    """POST every operator action; each must be a 409 starting with `prefix`."""
    messages = []
    for action in ACTIONS:
        async with http.post(f"{rr.url}/admin/engines/p0/{action}") as resp:
            body = await resp.json()
            assert resp.status == 409, (action, resp.status, body)
        error = body["error"]
        assert error["code"] == 409 and error["type"] == "conflict_error", body
        assert error["message"].startswith(prefix), error["message"]
        messages.append(error["message"])
    return messages


async def test_a_standby_refuses_operator_actions_and_names_the_active(
    start_router: StartRouter, tmp_path: Path
) -> None:
    lease_path = tmp_path / "state" / "lease.json"
    hold_lease(lease_path, "router-a", 3, HOUR_S)
    rr = await start_router(
        ENGINES,
        router_kwargs={"standby": True},
        lease={"backend": "file", "path": str(lease_path)},
    )
    async with aiohttp.ClientSession() as http:
        messages = await refused_everywhere(http, rr, "standby: ")
        assert all("router-a" in m for m in messages), messages
        engines = await get_json(http, f"{rr.url}/admin/engines")
        assert all(e["holds"] == [] for e in engines["engines"]), engines
        lease = await get_json(http, f"{rr.url}/admin/lease")
    assert (lease["role"], lease["holder"], lease["epoch"]) == ("standby", "router-a", 3)
    assert HOUR_S - 60 < lease["time_left_s"] <= HOUR_S, lease


async def test_a_fenced_router_refuses_operator_actions(
    start_router: StartRouter, tmp_path: Path
) -> None:
    """The active accepts a drain; once another router took the lease it is fenced and refuses."""
    lease_path = tmp_path / "state" / "lease.json"
    rr = await start_router(
        ENGINES,
        lease={"backend": "file", "path": str(lease_path), "ttl_s": 2.0, "renew_interval_s": 0.4},
    )
    async with aiohttp.ClientSession() as http:
        lease = await get_json(http, f"{rr.url}/admin/lease")
        assert lease["role"] == "active", lease
        async with http.post(f"{rr.url}/admin/engines/p0/drain") as resp:
            assert resp.status == 200, await resp.text()
        hold_lease(lease_path, "router-a", lease["epoch"] + 1, HOUR_S)  # router-a took it

        async def fenced() -> dict[str, Any] | None:
            view: dict[str, Any] = await get_json(http, f"{rr.url}/admin/lease")
            return view if view["role"] == "fenced" and view["holder"] == "router-a" else None

        await eventually(fenced, timeout_s=10, what="fenced, having seen router-a")
        # Fenced by its next renewal or handoff write, whichever found the new epoch first.
        messages = await refused_everywhere(http, rr, "fenced: ")
        assert all("; the active is router-a;" in m for m in messages), messages
