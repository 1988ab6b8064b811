"""The admin API end to end: bearer-token auth, 404/405, the engine view, the loopback rule.

DESIGN §6: the admin API lives under `/admin` (bearer token when configured; refuses to listen
off loopback without one): `GET /admin/engines` -> `{"engines": [{"id", "url", "role",
"eligible", "ejected", "holds", "evidence", "liveness_misses", "in_flight", ...}]}`,
`POST /admin/engines/{id}/drain|maintenance|readmit`, `GET /admin/monitor|handoff|lease`.
`holds` is a list of hold names and `ejected` a boolean (DESIGN's names are used everywhere);
the objects behind them are `hold_details` and `ejection` (docs/readmission.md).
docs/configuration.md: `admin.token`, `admin.token_env`, `admin.token_file` (trimmed; empty
means no token).
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from tests.e2e.test_readmission_support import (
    DECODE,
    PREFILL,
    TOKEN,
    Admin,
    RouterProcess,
    engine,
    free_port,
    hold_names,
)
from tests.support.router import RunningRouter, StartRouter, router_config
from tests.support.sim_process import SimFactory, SimProcess

GETS = ("/admin/engines", "/admin/monitor", "/admin/handoff", "/admin/lease", "/admin/flow")
POSTS = ("/admin/engines/p0/drain", "/admin/engines/p0/maintenance", "/admin/engines/p0/readmit")
FAILURE_CLASSES = {"connection", "timeout", "stream", "overload", "inference_status", "kv_handoff"}


@pytest.fixture(scope="module")
def sims() -> Iterator[tuple[SimProcess, SimProcess]]:
    factory = SimFactory()
    try:
        prefill, decode = factory.start_many([list(PREFILL), list(DECODE)])
        yield prefill, decode
    finally:
        factory.close()


def fleet(sims: tuple[SimProcess, SimProcess]) -> list[dict[str, Any]]:
    return [engine("p0", sims[0].url, "prefill"), engine("d0", sims[1].url, "decode")]


async def call(
    http: aiohttp.ClientSession, method: str, url: str, auth: str | None
) -> tuple[int, Any]:
    headers = {"Authorization": auth} if auth is not None else {}
    async with http.request(method, url, headers=headers) as resp:
        return resp.status, await resp.json(content_type=None)


async def guarded(start_router: StartRouter, sims: Any, **admin: Any) -> RunningRouter:
    return await start_router(fleet(sims), admin=admin or {"token": TOKEN})


# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "auth",
    [
        None,
        "Bearer wrong",
        "s3cret",
        "Bearer s3cret-and-more",
        "Bearer s3cre",
        "Basic czNjcmV0",
        "",
        "Bearer  s3cret",
    ],
    ids=["missing", "wrong", "no-scheme", "longer", "prefix", "basic", "empty", "double-space"],
)
async def test_admin_endpoints_refuse_a_missing_or_wrong_token(
    sims: Any, start_router: StartRouter, http: aiohttp.ClientSession, auth: str | None
) -> None:
    rr = await guarded(start_router, sims)
    for method, path in [*(("GET", p) for p in GETS), *(("POST", p) for p in POSTS)]:
        status, body = await call(http, method, rr.url + path, auth)
        assert status == 401, (method, path, body)
        assert body["error"]["code"] == 401 and body["error"]["type"] == "unauthorized"
        assert "token" in body["error"]["message"]
    # Refused requests had no effect: nothing is drained or in maintenance.
    assert [e["holds"] for e in await Admin(http, rr.url).engines()] == [[], []]


async def test_admin_endpoints_answer_the_right_bearer_token(
    sims: Any, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    rr = await guarded(start_router, sims)
    auth = f"Bearer {TOKEN}"
    for path in GETS:
        status, body = await call(http, "GET", rr.url + path, auth)
        assert status == 200, (path, body)
    status, body = await call(http, "POST", rr.url + "/admin/engines/p0/drain", auth)
    assert (status, body) == (200, {"engine": "p0", "hold": "operator_drain"})
    status, body = await call(http, "POST", rr.url + "/admin/engines/d0/maintenance", auth)
    assert (status, body) == (200, {"engine": "d0", "hold": "planned_maintenance"})
    status, body = await call(http, "POST", rr.url + "/admin/engines/p0/readmit", auth)
    assert status == 200 and body["engine"] == "p0" and body["readmitted"] is True, body
    assert [set(s) for s in body["steps"]] == [{"step", "ok", "status", "reason"}] * len(
        body["steps"]
    )


async def test_public_endpoints_need_no_admin_token(
    sims: Any, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    rr = await guarded(start_router, sims)
    await Admin(http, rr.url).wait_ready()
    for path in ("/health", "/ready", "/metrics", "/v1/models"):
        async with http.get(rr.url + path) as resp:
            assert resp.status == 200, path


async def test_unknown_engine_is_404_after_auth(
    sims: Any, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    rr = await guarded(start_router, sims)
    for action in ("drain", "maintenance", "readmit"):
        url = f"{rr.url}/admin/engines/nope/{action}"
        status, body = await call(http, "POST", url, f"Bearer {TOKEN}")
        assert status == 404, body
        assert body["error"]["code"] == 404 and "nope" in body["error"]["message"]
        status, _ = await call(http, "POST", url, None)
        assert status == 401  # without the token, not even whether the engine exists


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/admin/engines/x/drain"),
        ("GET", "/admin/engines/p0/drain"),
        ("GET", "/admin/engines/p0/maintenance"),
        ("GET", "/admin/engines/p0/readmit"),
        ("DELETE", "/admin/engines/p0/drain"),
        ("PUT", "/admin/engines"),
        ("POST", "/admin/monitor"),
    ],
)
async def test_wrong_method_is_405(
    sims: Any, start_router: StartRouter, http: aiohttp.ClientSession, method: str, path: str
) -> None:
    rr = await guarded(start_router, sims)
    async with http.request(
        method, rr.url + path, headers={"Authorization": f"Bearer {TOKEN}"}
    ) as r:
        assert r.status == 405
    assert [e["holds"] for e in await Admin(http, rr.url).engines()] == [[], []]


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/admin/engines/p0/drain"),
        ("DELETE", "/admin/engines/p0/drain"),
        ("POST", "/admin/engines"),
        ("GET", "/admin/nope"),
        ("GET", "/admin/engines/p0"),
        ("GET", "/admin"),
        ("PUT", "/admin/"),
    ],
)
async def test_without_the_token_every_admin_path_is_401_before_404_or_405(
    sims: Any, start_router: StartRouter, http: aiohttp.ClientSession, method: str, path: str
) -> None:
    rr = await guarded(start_router, sims)
    status, body = await call(http, method, rr.url + path, None)
    assert status == 401, body
    assert body["error"]["type"] == "unauthorized"
    # Outside /admin the router's own 404 stands.
    async with http.get(rr.url + "/administrator") as resp:
        assert resp.status == 404


BAD_BODIES = {
    "not-json": b"{not json",
    "array": b'["reason"]',
    "string": b'"drain it"',
    "number": b"42",
    "null": b"null",
    "reason-number": b'{"reason": 7}',
    "reason-object": b'{"reason": {"why": "x"}}',
    "truncated": b'{"reason": "kernel',
}


@pytest.mark.parametrize("action", ["drain", "maintenance", "readmit"])
@pytest.mark.parametrize("raw", list(BAD_BODIES.values()), ids=list(BAD_BODIES))
async def test_a_malformed_admin_body_is_400_and_changes_nothing(
    sims: Any, start_router: StartRouter, http: aiohttp.ClientSession, action: str, raw: bytes
) -> None:
    rr = await guarded(start_router, sims)
    admin = Admin(http, rr.url)
    url = f"{rr.url}/admin/engines/p0/{action}"
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    async with http.post(url, data=raw, headers=headers) as resp:
        status, body = resp.status, await resp.json(content_type=None)
    assert status == 400, body
    assert body["error"]["code"] == 400 and body["error"]["type"] == "invalid_request_error"
    e = await admin.engine("p0")
    assert e["holds"] == [] and e["readmission"] == [], e  # not drained, nothing verified
    assert 'narwhal_readmissions_total{engine="p0"' not in await admin.metrics()


@pytest.mark.parametrize("raw", [b"", b"{}", b"  ", b'{"reason": "kernel 6.9 upgrade"}'])
async def test_an_admin_body_may_be_empty_or_an_object_with_a_reason(
    sims: Any, start_router: StartRouter, http: aiohttp.ClientSession, raw: bytes
) -> None:
    rr = await guarded(start_router, sims)
    admin = Admin(http, rr.url)
    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with http.post(f"{rr.url}/admin/engines/p0/drain", data=raw, headers=headers) as r:
        assert (r.status, await r.json()) == (200, {"engine": "p0", "hold": "operator_drain"})
    (hold,) = (await admin.engine("p0"))["hold_details"]
    reason = "kernel 6.9 upgrade" if b"reason" in raw else None
    assert hold["reason"] == ("operator request: " + reason if reason else "operator request")


async def test_token_from_an_environment_variable(
    sims: Any, start_router: StartRouter, http: aiohttp.ClientSession,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    monkeypatch.setenv("NARWHAL_TEST_ADMIN_TOKEN", "from-env")
    rr = await guarded(start_router, sims, token_env="NARWHAL_TEST_ADMIN_TOKEN")
    assert (await call(http, "GET", rr.url + "/admin/engines", "Bearer from-env"))[0] == 200
    assert (await call(http, "GET", rr.url + "/admin/engines", None))[0] == 401


async def test_token_from_a_file_is_trimmed(
    sims: Any, start_router: StartRouter, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    token_file = tmp_path / "admin-token"
    token_file.write_text("  from-file\n")
    rr = await guarded(start_router, sims, token_file=str(token_file))
    assert (await call(http, "GET", rr.url + "/admin/engines", "Bearer from-file"))[0] == 200
    assert (await call(http, "GET", rr.url + "/admin/engines", "Bearer   from-file"))[0] == 401
    assert (await call(http, "GET", rr.url + "/admin/engines", None))[0] == 401


async def test_without_a_token_the_loopback_admin_api_is_open(
    sims: Any, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    rr = await start_router(fleet(sims))
    assert (await call(http, "GET", rr.url + "/admin/engines", None))[0] == 200
    assert (await call(http, "GET", rr.url + "/admin/engines", "Bearer anything"))[0] == 200


async def test_admin_engines_view(
    sims: Any, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    rr = await guarded(start_router, sims)
    admin = Admin(http, rr.url)
    await admin.wait_engine("p0", lambda e: e["generation"] is not None, "generation learned")
    await admin.drain("p0")
    by_id = {e["id"]: e for e in await admin.engines()}
    assert list(by_id) == ["p0", "d0"]
    required = {"id", "url", "role", "eligible", "ejected", "ejection", "holds", "hold_details",
                "evidence", "liveness_misses", "in_flight", "drain_settled", "readmission",
                "generation"}  # fmt: skip
    for e in by_id.values():
        assert required <= set(e), set(e)
        assert set(e["evidence"]) == FAILURE_CLASSES and set(e["evidence"].values()) == {0}
    p0, d0 = by_id["p0"], by_id["d0"]
    assert (p0["url"], p0["role"], p0["kv_role"]) == (sims[0].url, "prefill", "kv_producer")
    assert (d0["url"], d0["role"], d0["kv_role"]) == (sims[1].url, "decode", "kv_consumer")
    assert p0["eligible"] is False and d0["eligible"] is True
    assert p0["ejected"] is False and p0["liveness_misses"] == 0 and p0["in_flight"] == 0
    assert hold_names(p0) == ["operator_drain"]
    hold = p0["hold_details"][0]
    assert set(hold) == {"name", "reason", "since", "deadline"} and hold["deadline"] is None
    assert isinstance(hold["since"], float)
    assert p0["generation"] == await asyncio.to_thread(sims[0].process_start_time)


async def test_admin_engines_holds_are_names_and_ejected_is_a_boolean(
    sims: Any, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    """The black-box contract: `"operator_drain" in engine["holds"]`, `engine["ejected"] is
    True/False`; the hold objects and the ejection record sit beside them."""
    dead = engine("d1", "http://127.0.0.1:9", "decode")  # nothing listens: ejected
    rr = await start_router([*fleet(sims), dead], admin={"token": TOKEN})
    admin = Admin(http, rr.url)
    await admin.drain("p0")
    p0 = await admin.engine("p0")
    assert "operator_drain" in p0["holds"] and p0["holds"] == ["operator_drain"]
    assert p0["hold_details"][0]["name"] == "operator_drain"
    assert p0["hold_details"][0]["reason"] == "operator request"
    assert p0["ejected"] is False and p0["ejection"] is None

    d1 = await admin.wait_engine("d1", lambda e: e["ejected"] is True, "d1 ejected", 10)
    assert d1["ejection"]["cause"] in ("connection", "liveness"), d1["ejection"]
    assert d1["ejection"]["class"] == d1["ejection"]["cause"]
    assert d1["eligible"] is False
    d0 = await admin.engine("d0")
    assert d0["ejected"] is False and d0["ejection"] is None
    assert d0["holds"] == [] and d0["hold_details"] == []


# --------------------------------------------------------------------------------------------
# The loopback rule: narwhal-serve refuses a non-loopback listen address without a token.


OFFLINE = [
    engine("p0", "http://127.0.0.1:9", "prefill"),
    engine("d0", "http://127.0.0.1:10", "decode"),
]


def serve_config(tmp_path: Path, listen: str, **extra: Any) -> Path:
    config = router_config(OFFLINE, tmp_path, **extra)
    config["listen"] = listen
    path = tmp_path / "narwhal.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


async def serve(*args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("NARWHAL_")}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "narwhal.cli.serve", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**clean, **(env or {})},
    )  # fmt: skip
    try:
        async with asyncio.timeout(20):
            out, err = await proc.communicate()
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise AssertionError(
            "narwhal-serve did not exit: it must refuse before listening"
        ) from None
    return proc.returncode or 0, (out + err).decode()


@pytest.mark.parametrize(
    ("listen", "admin"),
    [
        ("0.0.0.0", None),
        ("[::]", None),
        ("192.0.2.10", None),
        ("router.example.invalid", None),
        ("0.0.0.0", {"token_env": "NARWHAL_TEST_UNSET_TOKEN"}),
        ("0.0.0.0", {"token_file": "EMPTY"}),
    ],
    ids=["any-v4", "any-v6", "public-v4", "hostname", "unset-env-token", "blank-token-file"],
)
async def test_serve_refuses_a_non_loopback_listen_without_an_admin_token(
    tmp_path: Path, listen: str, admin: dict[str, Any] | None
) -> None:
    if admin is not None and admin.get("token_file") == "EMPTY":
        (tmp_path / "blank-token").write_text(" \n")
        admin = {"token_file": str(tmp_path / "blank-token")}
    extra = {"admin": admin} if admin is not None else {}
    path = serve_config(tmp_path, f"{listen}:{free_port()}", **extra)
    code, output = await serve("--config", str(path))
    assert code == 2, output
    assert "admin" in output and "token" in output, output
    assert "listening" not in output


async def test_the_demo_refuses_a_non_loopback_listen() -> None:
    """The demo has no admin token, so it follows the same rule, before starting any sim."""
    code, output = await serve("--demo", "--listen", f"0.0.0.0:{free_port()}")
    assert code == 2, output
    assert "admin" in output and "token" in output, output
    assert "listening" not in output


@pytest.mark.parametrize("token", ["", "   "], ids=["empty", "blank"])
def test_a_blank_inline_token_is_no_token(token: str) -> None:
    """A blank `admin.token` is no token (it could never be presented): the loopback rule
    applies. Checked in-process: a regression would make narwhal-serve listen on 0.0.0.0."""
    from narwhal.cli.serve import check_startable
    from narwhal.config import ConfigError, parse_config

    data = router_config(OFFLINE, Path("/nonexistent"), admin={"token": token})
    data["listen"] = "0.0.0.0:8080"
    try:
        problems = check_startable(parse_config(data))
    except ConfigError as exc:
        problems = exc.problems
    assert any(p.startswith("admin") for p in problems), problems


async def test_a_blank_inline_token_is_treated_as_no_token_on_loopback(
    sims: Any, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    from narwhal.config import ConfigError

    try:
        rr = await guarded(start_router, sims, token="")
    except ConfigError:
        return  # refused at load: fine
    # No token: the loopback admin API is open, as with an empty token_env or token_file.
    status, _ = await call(http, "POST", rr.url + "/admin/engines/p0/drain", None)
    assert status == 200, "an empty token must mean no token, not a token nobody can send"


async def test_serve_refuses_a_non_loopback_listen_override_without_an_admin_token(
    tmp_path: Path,
) -> None:
    path = serve_config(tmp_path, f"127.0.0.1:{free_port()}")
    code, output = await serve("--config", str(path), "--listen", f"0.0.0.0:{free_port()}")
    assert code == 2, output
    assert "admin" in output, output


async def test_check_config_applies_the_listen_rule_as_a_start_does(tmp_path: Path) -> None:
    path = serve_config(tmp_path, f"0.0.0.0:{free_port()}")
    code, output = await serve("--check-config", str(path))
    assert code == 2, output
    assert "admin" in output, output


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
async def test_serve_listens_on_loopback_without_a_token(
    sims: Any, tmp_path: Path, http: aiohttp.ClientSession, host: str
) -> None:
    proc = RouterProcess(router_config(fleet(sims), tmp_path), tmp_path, {})
    proc.config["listen"] = f"{host}:{proc.port}"
    await proc.start()
    try:
        assert (await call(http, "GET", proc.url + "/admin/engines", None))[0] == 200
    finally:
        await proc.stop()


async def test_serve_with_a_token_guards_the_admin_api(
    sims: Any, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    proc = RouterProcess(
        router_config(fleet(sims), tmp_path, admin={"token_env": "NARWHAL_ADMIN_TOKEN"}),
        tmp_path,
        {"NARWHAL_ADMIN_TOKEN": "env-secret"},
    )
    await proc.start()
    try:
        assert (await call(http, "GET", proc.url + "/admin/engines", None))[0] == 401
        ok = await call(http, "GET", proc.url + "/admin/engines", "Bearer env-secret")
        assert ok[0] == 200
    finally:
        await proc.stop()
