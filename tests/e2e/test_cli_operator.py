"""The operator CLI (`narwhal`) end to end, as a subprocess against a running router.

DESIGN §6: `narwhal` over the admin API: status, engines, drain, maintenance, readmit, handoff
inspect/validate, lease; `--url`/`--token` or `NARWHAL_URL`/`NARWHAL_ADMIN_TOKEN`. Exit 0 on
success, 1 on a refused or failed operation (with a message on stderr), 2 on usage errors.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from aiohttp import web

import narwhal as narwhal_package
from tests.e2e.test_readmission_support import (
    DECODE,
    PREFILL,
    TOKEN,
    Admin,
    engine,
    free_port,
    hold_names,
)
from tests.support.cli import narwhal
from tests.support.poll import eventually
from tests.support.router import RunningRouter, StartRouter, router_config
from tests.support.sim_process import SimFactory, SimProcess


@dataclass
class Fleet:
    p0: SimProcess
    p1: SimProcess
    d0: SimProcess

    def engines(self) -> list[dict[str, Any]]:
        return [
            engine("p0", self.p0.url, "prefill"),
            engine("p1", self.p1.url, "prefill"),
            engine("d0", self.d0.url, "decode"),
        ]


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    factory = SimFactory()
    try:
        yield Fleet(*factory.start_many([list(PREFILL), list(PREFILL), list(DECODE)]))
    finally:
        factory.close()


@dataclass
class Setup:
    rr: RunningRouter
    admin: Admin

    def args(self, *rest: str, token: str | None = TOKEN) -> tuple[str, ...]:
        return ("--url", self.rr.url, *(("--token", token) if token else ()), *rest)


@pytest.fixture
async def setup(fleet: Fleet, start_router: StartRouter, http: aiohttp.ClientSession) -> Setup:
    rr = await start_router(fleet.engines(), admin={"token": TOKEN})
    admin = Admin(http, rr.url)
    await admin.wait_ready()
    await admin.wait_engine("p0", lambda e: e["generation"] is not None, "generation learned")
    return Setup(rr, admin)


def table(out: str) -> dict[str, dict[str, str]]:
    """The engine table: rows keyed by engine id, cells keyed by header."""
    lines = out.splitlines()
    header = lines[0].split()
    rows: dict[str, dict[str, str]] = {}
    for line in lines[1:]:
        if not line.strip():
            break
        cells = line.split()
        assert len(cells) == len(header), (header, line)
        rows[cells[0]] = dict(zip(header, cells, strict=True))
    return rows


# --------------------------------------------------------------------------------------------
async def test_status_shows_engines_roles_eligibility_holds_evidence_and_the_monitor(
    setup: Setup, fleet: Fleet
) -> None:
    await setup.admin.drain("p0")
    # One failed health check on p1 leaves inference_status evidence (a health 200 does not
    # clear that class).
    fault = {"kind": "health_status", "status": 500, "count": 1}
    await asyncio.to_thread(fleet.p1.add_fault, fault)
    await setup.admin.wait_engine(
        "p1", lambda e: e["evidence"]["inference_status"] == 1, "evidence recorded"
    )
    result = await narwhal(*setup.args("status"))
    assert result.code == 0, result
    rows = table(result.out)
    assert list(rows) == ["p0", "p1", "d0"]
    header = result.out.splitlines()[0].split()
    assert header[:2] == ["ENGINE", "ROLE"]
    assert {"ELIGIBLE", "HOLDS", "EVIDENCE", "EJECTED"} <= set(header)
    assert rows["p0"]["ROLE"] == "prefill" and rows["d0"]["ROLE"] == "decode"
    assert rows["p0"]["ELIGIBLE"] == "no" and rows["p0"]["HOLDS"] == "operator_drain"
    assert rows["p1"]["ELIGIBLE"] == "yes" and rows["p1"]["HOLDS"] == "-"
    assert rows["p1"]["EVIDENCE"] == "inference_status=1"
    assert rows["d0"]["EVIDENCE"] == "-" and rows["d0"]["EJECTED"] == "-"
    monitor = [line for line in result.out.splitlines() if line.startswith("monitor:")]
    assert monitor == ["monitor: streak 0/3, admitting: yes"], result.out


async def test_engines_json_is_the_admin_engines_document(setup: Setup) -> None:
    await setup.admin.drain("p1")

    async def printed_matches() -> bool:
        """The CLI's document equals the API's, read while no monitor pass changed it (a pass
        settles the drain and learns generations, so the document moves between passes)."""
        before = await setup.admin.get("/admin/engines")
        result = await narwhal(*setup.args("engines", "--json"))
        after = await setup.admin.get("/admin/engines")
        assert result.code == 0, result
        assert before[0] == after[0] == 200
        if before != after:
            return False
        assert json.loads(result.out) == after[1]
        return True

    await eventually(printed_matches, timeout_s=10, what="a document read between passes")


async def test_engines_without_json_prints_the_table(setup: Setup) -> None:
    result = await narwhal(*setup.args("engines"))
    assert result.code == 0, result
    assert list(table(result.out)) == ["p0", "p1", "d0"]
    assert "monitor:" not in result.out


async def test_drain_then_the_hold_is_visible(setup: Setup) -> None:
    result = await narwhal(*setup.args("drain", "p0"))
    assert result.code == 0, result
    assert result.out.strip() == "p0: operator_drain"
    e = await setup.admin.engine("p0")
    assert hold_names(e) == ["operator_drain"] and e["eligible"] is False
    status = await narwhal(*setup.args("status"))
    assert table(status.out)["p0"]["HOLDS"] == "operator_drain"


async def test_maintenance_then_readmit_is_refused_for_the_same_process(setup: Setup) -> None:
    result = await narwhal(*setup.args("maintenance", "p0"))
    assert result.code == 0, result
    assert result.out.strip() == "p0: planned_maintenance"
    assert hold_names(await setup.admin.engine("p0")) == ["planned_maintenance"]

    result = await narwhal(*setup.args("readmit", "p0"))
    assert result.code == 1, result
    lines = result.out.splitlines()
    assert lines[-1] == "not readmitted"
    assert lines[0].startswith("ok") and lines[0].split()[1] == "health:"
    fail = [line for line in lines if line.startswith("FAIL")]
    assert len(fail) == 1 and fail[0].startswith("FAIL generation_identity: planned maintenance")
    assert lines[-2] == fail[0]  # nothing runs after the failed step
    assert hold_names(await setup.admin.engine("p0")) == ["planned_maintenance"]


async def test_readmit_prints_every_step_and_exits_0(setup: Setup) -> None:
    await narwhal(*setup.args("drain", "p0"))
    result = await narwhal(*setup.args("readmit", "p0"))
    assert result.code == 0, result
    e = await setup.admin.engine("p0")
    assert e["holds"] == []
    labels = {"passed": "ok  ", "not_configured": "skip"}
    expected = [f"{labels[s['status']]} {s['step']}: {s['reason']}" for s in e["readmission"]]
    assert result.out.splitlines() == [*expected, "readmitted"]
    # No attestation configured: reported as such, not as a passed check.
    attestation = [line for line in result.out.splitlines() if " attestation: " in line]
    assert attestation == ["skip attestation: attestation not configured"], result.out


@pytest.mark.parametrize("action", ["drain", "maintenance", "readmit"])
async def test_unknown_engine_id_exits_1_with_a_clear_message(setup: Setup, action: str) -> None:
    result = await narwhal(*setup.args(action, "nope"))
    assert result.code == 1, result
    assert result.out == ""
    assert "404" in result.err and "no engine 'nope'" in result.err, result.err
    assert "Traceback" not in result.err


@pytest.mark.parametrize("command", [("status",), ("engines", "--json"), ("drain", "p0"),
                                     ("readmit", "p0"), ("lease",)])  # fmt: skip
async def test_a_wrong_token_exits_1_mentioning_401(setup: Setup, command: tuple[str, ...]) -> None:
    for token in ("wrong", None):
        result = await narwhal(*setup.args(*command, token=token))
        assert result.code == 1, result
        assert "401" in result.err, result.err
        assert "Traceback" not in result.err
    assert (await setup.admin.engine("p0"))["holds"] == []  # the drain was refused


@pytest.mark.parametrize("command", [("status",), ("drain", "p0"), ("readmit", "p0"), ("lease",)])
async def test_an_unreachable_router_exits_1_with_a_clear_message(
    command: tuple[str, ...],
) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    result = await narwhal("--url", url, "--token", TOKEN, *command)
    assert result.code == 1, result
    assert result.err.startswith(f"narwhal: cannot reach {url}"), result.err
    assert "Traceback" not in result.err


async def test_url_and_token_from_the_environment(setup: Setup) -> None:
    env = {"NARWHAL_URL": setup.rr.url, "NARWHAL_ADMIN_TOKEN": TOKEN}
    result = await narwhal("drain", "p1", env=env)
    assert result.code == 0, result
    assert hold_names(await setup.admin.engine("p1")) == ["operator_drain"]
    # Flags win over the environment.
    result = await narwhal("--token", "wrong", "status", env=env)
    assert result.code == 1 and "401" in result.err


async def test_url_and_token_may_follow_the_subcommand(setup: Setup) -> None:
    """`narwhal drain p1 --url U --token T` works as well as `narwhal --url U --token T drain
    p1`, for every subcommand."""
    flags = ("--url", setup.rr.url, "--token", TOKEN)
    status = await narwhal("status", *flags)
    assert status.code == 0, status
    assert list(table(status.out)) == ["p0", "p1", "d0"]
    drain = await narwhal("drain", "p1", *flags)
    assert (drain.code, drain.out) == (0, "p1: operator_drain\n"), drain
    assert hold_names(await setup.admin.engine("p1")) == ["operator_drain"]
    inspect = await narwhal("handoff", "inspect", *flags)
    assert inspect.code == 0, inspect
    assert inspect.out.startswith(f"path {setup.rr.router.handoff.path}  sequence "), inspect
    # Between `handoff` and `inspect` too.
    between = await narwhal("handoff", "--url", setup.rr.url, "--token", TOKEN, "inspect")
    assert between.code == 0, between


async def test_flags_after_the_subcommand_combine_with_the_top_level_and_environment(
    setup: Setup,
) -> None:
    """Absent after the subcommand, the top-level flag or the environment still applies;
    present in both places, the one after the subcommand wins."""
    env = {"NARWHAL_URL": setup.rr.url, "NARWHAL_ADMIN_TOKEN": "wrong"}
    from_env = await narwhal("status", "--token", TOKEN, env=env)  # URL from the environment
    assert from_env.code == 0, from_env
    from_top = await narwhal("--url", setup.rr.url, "status", "--token", TOKEN)
    assert from_top.code == 0, from_top
    dead = f"http://127.0.0.1:{free_port()}"
    later_wins = await narwhal("--url", dead, "lease", "--url", setup.rr.url, "--token", TOKEN)
    assert later_wins.code == 0, later_wins
    wrong_after = await narwhal("status", "--token", "wrong", env={"NARWHAL_URL": setup.rr.url})
    assert wrong_after.code == 1 and "401" in wrong_after.err, wrong_after


async def test_lease_prints_the_lease_view(setup: Setup) -> None:
    result = await narwhal(*setup.args("lease"))
    assert result.code == 0, result
    assert json.loads(result.out) == {
        "backend": "none",
        "role": "active",
        "router_id": "test-router",
    }


async def test_usage_errors_exit_2() -> None:
    assert (await narwhal()).code == 2
    assert (await narwhal("drain")).code == 2  # no engine id
    assert (await narwhal("explode")).code == 2


@pytest.mark.slow
async def test_handoff_inspect_and_validate_a_live_routers_handoff(
    setup: Setup, fleet: Fleet, tmp_path: Path
) -> None:
    await setup.admin.drain("p0")

    async def written() -> bool:
        _status, body = await setup.admin.get("/admin/handoff")
        doc = body["document"]
        return bool(doc and [h["name"] for h in doc["engines"]["p0"]["holds"]])

    await eventually(written, what="a handoff with the drain")
    path = str(setup.rr.router.handoff.path)
    # Over the admin API (no file): the router's latest document.
    live = await narwhal(*setup.args("handoff", "inspect"))
    assert live.code == 0, live
    assert live.out.startswith(f"path {path}  sequence "), live
    p0_line = next(line for line in live.out.splitlines() if line.startswith("p0 "))
    assert "holds=operator_drain" in p0_line and "prefill" in p0_line
    # A file, offline; `show` is the same command.
    for command in ("inspect", "show"):
        shown = await narwhal("handoff", command, path)
        assert shown.code == 0, shown
        p0_line = next(line for line in shown.out.splitlines() if line.startswith("p0 "))
        assert "holds=operator_drain" in p0_line and "prefill" in p0_line

    config = tmp_path / "same-fleet.yaml"
    config.write_text(yaml.safe_dump(router_config(fleet.engines(), tmp_path)))
    valid = await narwhal("handoff", "validate", path, "--config", str(config))
    assert valid.code == 0 and valid.out.startswith("valid"), valid

    other = tmp_path / "other-fleet.yaml"
    engines = [*fleet.engines()[:2], engine("d9", "http://127.0.0.1:9", "decode")]
    other.write_text(yaml.safe_dump(router_config(engines, tmp_path)))
    invalid = await narwhal("handoff", "validate", path, "--config", str(other))
    assert invalid.code == 1 and invalid.out.startswith("invalid"), invalid

    missing = await narwhal("handoff", "show", str(tmp_path / "nope.json"))
    assert missing.code == 1 and "no such file" in missing.err


# --------------------------------------------------------------------------- robustness
async def test_a_malformed_url_is_a_usage_error_without_a_traceback() -> None:
    for command in (("status",), ("drain", "p0"), ("lease",), ("handoff", "inspect")):
        result = await narwhal("--url", "foo", *command)
        assert result.code == 2, result
        assert result.err.startswith("narwhal: error: argument --url: 'foo' "), result.err
        assert "Traceback" not in result.err


BAD_FLAGS = [
    pytest.param(["status", "--url", "ftp://x"], "narwhal status", "--url", id="url-after"),
    pytest.param(["status", "--watch", "--interval-s", "nan"], "narwhal status", "--interval-s",
                 id="interval-nan"),
    pytest.param(["status", "--watch", "--interval-s", "-1"], "narwhal status", "--interval-s",
                 id="interval-negative"),
    pytest.param(["status", "--watch", "--count", "0"], "narwhal status", "--count", id="count"),
    pytest.param(["drain", "p0", "--wait", "--timeout-s", "inf"], "narwhal drain", "--timeout-s",
                 id="drain-timeout"),
    pytest.param(["engines", "remove", "p0", "--timeout-s", "-5"], "narwhal engines remove",
                 "--timeout-s", id="membership-timeout"),
    pytest.param(["engines", "add", "e9", "http://h:1", "--role", "encode"],
                 "narwhal engines add", "--role", id="bad-role"),
    pytest.param(["explode"], "narwhal", "explode", id="unknown-command"),
]  # fmt: skip


@pytest.mark.parametrize(("args", "prog", "flag"), BAD_FLAGS)
async def test_a_bad_flag_exits_2_with_one_line_before_calling_the_router(
    args: list[str], prog: str, flag: str
) -> None:
    # No router at this URL: a flag checked only after a call would exit 1 instead.
    result = await narwhal("--url", f"http://127.0.0.1:{free_port()}", *args)
    assert result.code == 2, result
    assert result.out == ""
    (line,) = result.err.splitlines()  # one line, no usage block, no traceback
    assert line.startswith(f"{prog}: error: "), line
    assert flag in line, line


async def test_version_prints_the_installed_distribution_version() -> None:
    result = await narwhal("--version")
    assert result.code == 0, result
    assert result.out == f"narwhal {narwhal_package.version()}\n"


Answer = tuple[int, str, str]  # status, content type, body


@pytest.fixture
async def fake_admin() -> AsyncIterator[tuple[str, dict[str, Answer]]]:
    """Not a narwhal router: answers each path from a table (default: a 200 HTML page)."""
    answers: dict[str, Answer] = {}

    async def handle(request: web.Request) -> web.Response:
        status, content_type, body = answers.get(
            request.path, (200, "text/html", "<html><body>hello</body></html>")
        )
        return web.Response(status=status, text=body, content_type=content_type)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}", answers
    finally:
        await runner.cleanup()


@pytest.mark.parametrize(
    "command",
    [("status",), ("engines", "--json"), ("drain", "p0"), ("readmit", "p0"), ("lease",),
     ("handoff", "inspect")],
)  # fmt: skip
async def test_a_url_answering_html_exits_1_without_a_traceback(
    fake_admin: tuple[str, dict[str, Answer]], command: tuple[str, ...]
) -> None:
    url, _ = fake_admin
    result = await narwhal("--url", url, *command)
    assert result.code == 1, result
    assert result.err.startswith(f"narwhal: {url}/admin/"), result.err
    assert "answered 200 with something other than JSON" in result.err
    assert "Traceback" not in result.err


ENGINES_OK: Answer = (200, "application/json", '{"engines": [], "consolidation_risk": {}}')
LEASE_OK: Answer = (200, "application/json", '{"backend": "none", "role": "active"}')


async def test_status_with_a_failing_monitor_endpoint_exits_1_with_its_message(
    fake_admin: tuple[str, dict[str, Answer]],
) -> None:
    url, answers = fake_admin
    answers["/admin/engines"] = ENGINES_OK
    answers["/admin/lease"] = LEASE_OK
    answers["/admin/monitor"] = (503, "application/json", '{"error": {"message": "busy"}}')
    result = await narwhal("--url", url, "status")
    assert result.code == 1, result
    assert result.err == "narwhal: 503: busy\n"
    assert "Traceback" not in result.err


async def test_status_reports_an_unavailable_lease_view(
    fake_admin: tuple[str, dict[str, Answer]],
) -> None:
    url, answers = fake_admin
    answers["/admin/engines"] = ENGINES_OK
    answers["/admin/lease"] = (500, "application/json", '{"error": {"message": "boom"}}')
    answers["/admin/monitor"] = (
        200, "application/json",
        '{"streak": 0, "failure_limit": 3, "admitting": true, "degraded": null}',
    )  # fmt: skip
    result = await narwhal("--url", url, "status")
    assert result.code == 0, result
    assert "lease: unavailable (500: boom)" in result.out.splitlines()
    assert "monitor: streak 0/3, admitting: yes" in result.out.splitlines()


async def test_json_of_another_shape_exits_1_without_a_traceback(
    fake_admin: tuple[str, dict[str, Answer]],
) -> None:
    url, answers = fake_admin
    answers["/admin/engines"] = (200, "application/json", '{"something": "else"}')
    result = await narwhal("--url", url, "status")
    assert result.code == 1, result
    assert result.err.startswith(f"narwhal: unexpected answer from {url} (KeyError: "), result.err
    assert "Traceback" not in result.err


async def test_status_shows_the_file_lease_line(
    fleet: Fleet, start_router: StartRouter, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    lease = {"backend": "file", "path": str(tmp_path / "lease.json"), "ttl_s": 30.0,
             "renew_interval_s": 0.5}  # fmt: skip
    rr = await start_router(fleet.engines(), lease=lease)

    async def lease_view() -> Any:
        async with http.get(rr.url + "/admin/lease") as resp:
            return await resp.json()

    async def holding() -> bool:
        body = await lease_view()
        return bool(body.get("role") == "active" and body.get("epoch"))

    await eventually(holding, what="the router holding the file lease")
    result = await narwhal("--url", rr.url, "status")
    assert result.code == 0, result
    lines = [line for line in result.out.splitlines() if line.startswith("lease:")]
    assert len(lines) == 1, result.out
    epoch = (await lease_view())["epoch"]
    prefix = f"lease: file, this router active, holder test-router epoch {epoch}"
    assert lines[0].startswith(prefix), lines
