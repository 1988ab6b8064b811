"""Readmission steps end to end: each step failing on its own, named, with its reason.

Spec chapter "Failure, readmission, and state", section "Readmission and drains": before
returning an engine to placement Narwhal verifies health, attestation, model identity,
generation identity, role-permitted KV transfer and final health. DESIGN §2: steps run in
that order, stop at the first failure, and each failed step is reported with its name and
reason; attestation `none` is reported as not configured, `tls` needs an HTTPS engine whose
certificate chains to the configured CA and names the engine id, `command` lets an operator
program judge (exit status, JSON reason).

Every test drains the engine first (an operator takes it out, then asks for it back), calls
`POST /admin/engines/{id}/readmit`, and checks the answer (409 and the steps) against the
engine's `readmission` field in `/admin/engines`; a refused readmission leaves the drain.
Faults are real: killed processes, sim faults, another process answering on the engine's
URL, another CA's certificate served over real TLS.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.e2e.test_readmission_support import (
    DECODE,
    PREFILL,
    STEPS,
    TOKEN,
    Admin,
    EngineFront,
    Pki,
    RouterProcess,
    assert_failed_at,
    engine,
    hold_names,
)
from tests.support.router import RunningRouter, StartRouter, router_config
from tests.support.sim_process import SimFactory, SimProcess

STAY = {"eject_after": 1000, "liveness_misses": 1000}  # operator-driven: nothing is ejected


@dataclass
class Pair:
    prefill: SimProcess
    decode: SimProcess


@pytest.fixture(scope="module")
def pair() -> Iterator[Pair]:
    """A healthy prefill/decode pair shared by tests that inject nothing into it."""
    factory = SimFactory()
    try:
        prefill, decode = factory.start_many([list(PREFILL), list(DECODE)])
        yield Pair(prefill, decode)
    finally:
        factory.close()


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return Pki(tmp_path_factory.mktemp("pki"))


def pd(prefill_url: str, decode_url: str, **prefill_extra: Any) -> list[dict[str, Any]]:
    return [
        engine("p0", prefill_url, "prefill", **prefill_extra),
        engine("d0", decode_url, "decode"),
    ]


async def drained(
    start_router: StartRouter, http: aiohttp.ClientSession, engines: list[dict[str, Any]],
    target: str = "p0", **sections: Any,
) -> tuple[RunningRouter, Admin]:  # fmt: skip
    sections.setdefault("recovery", STAY)
    rr = await start_router(engines, admin={"token": TOKEN}, **sections)
    admin = Admin(http, rr.url)
    await admin.wait_engine(target, lambda e: e["generation"] is not None, "generation learned")
    await admin.drain(target)
    return rr, admin


async def refused(admin: Admin, engine_id: str, step: str, reason: str) -> dict[str, Any]:
    """Readmit: 409, the report stops at `step`; the engine field agrees; the drain stays."""
    status, body = await admin.readmit(engine_id)
    assert status == 409, body
    assert body["engine"] == engine_id and body["readmitted"] is False
    last = assert_failed_at(body["steps"], step, reason)
    e = await admin.engine(engine_id)
    assert e["readmission"] == body["steps"]
    assert hold_names(e) == ["operator_drain"] and e["eligible"] is False
    return last


# --------------------------------------------------------------------------------------------
# The full report


async def test_successful_readmission_reports_all_six_steps_in_order(
    pair: Pair, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    _, admin = await drained(start_router, http, pd(pair.prefill.url, pair.decode.url))
    status, body = await admin.readmit("p0")
    assert status == 200, body
    assert body["readmitted"] is True
    assert [s["step"] for s in body["steps"]] == list(STEPS)
    assert all(s["ok"] for s in body["steps"]), body
    e = await admin.engine("p0")
    assert e["readmission"] == body["steps"] and e["holds"] == [] and e["eligible"] is True


async def test_attestation_none_is_reported_not_configured_never_passed(
    pair: Pair, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    _, admin = await drained(start_router, http, pd(pair.prefill.url, pair.decode.url))
    status, body = await admin.readmit("p0")
    assert status == 200, body
    attestation = [s for s in body["steps"] if s["step"] == "attestation"]
    assert attestation == [
        {"step": "attestation", "ok": True, "status": "not_configured",
         "reason": "attestation not configured"}
    ]  # fmt: skip
    others = [s["status"] for s in body["steps"] if s["step"] != "attestation"]
    assert others == ["passed"] * 5


# --------------------------------------------------------------------------------------------
# health


@pytest.mark.slow
async def test_health_step_fails_when_the_engine_is_down(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    prefill, decode = sim_factory.start_many([list(PREFILL), list(DECODE)])
    _, admin = await drained(start_router, http, pd(prefill.url, decode.url))
    await asyncio.to_thread(prefill.kill)
    last = await refused(admin, "p0", "health", "connect")
    _, body = await admin.readmit("p0")
    assert [s["step"] for s in body["steps"]] == ["health"], "nothing runs after a failed step"
    assert last["reason"] == body["steps"][0]["reason"]


@pytest.mark.slow
async def test_health_step_fails_on_an_error_status(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    prefill, decode = sim_factory.start_many([list(PREFILL), list(DECODE)])
    _, admin = await drained(start_router, http, pd(prefill.url, decode.url))
    await asyncio.to_thread(prefill.add_fault, {"kind": "health_status", "status": 503})
    await refused(admin, "p0", "health", "health answered HTTP 503")


# --------------------------------------------------------------------------------------------
# attestation: command


def attest_script(tmp_path: Path, exit_code: int, stdout: str, sleep_s: float = 0.0) -> list[str]:
    """An operator program: records its arguments, prints `stdout`, exits `exit_code`."""
    record = tmp_path / "attest-args.json"
    script = tmp_path / "attest.py"
    script.write_text(
        "import json, sys, time\n"
        f"open({str(record)!r}, 'w').write(json.dumps(sys.argv[1:]))\n"
        f"time.sleep({sleep_s})\n"
        f"sys.stdout.write({stdout!r})\n"
        f"sys.exit({exit_code})\n"
    )
    return [sys.executable, str(script)]


async def test_command_attestation_refusal_is_reported_with_its_reason(
    pair: Pair, start_router: StartRouter, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    command = attest_script(tmp_path, 1, json.dumps({"reason": "denied by policy"}))
    _, admin = await drained(
        start_router, http, pd(pair.prefill.url, pair.decode.url),
        attestation={"kind": "command", "command": command},
    )  # fmt: skip
    last = await refused(admin, "p0", "attestation", "denied by policy")
    assert last["reason"] == "denied by policy"
    _, body = await admin.readmit("p0")
    assert [s["step"] for s in body["steps"]] == ["health", "attestation"]


async def test_command_attestation_approval_passes_and_sees_the_engine(
    pair: Pair, start_router: StartRouter, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    command = attest_script(tmp_path, 0, json.dumps({"reason": "approved by policy"}))
    _, admin = await drained(
        start_router, http, pd(pair.prefill.url, pair.decode.url),
        attestation={"kind": "command", "command": command},
    )  # fmt: skip
    status, body = await admin.readmit("p0")
    assert status == 200, body
    assert {"step": "attestation", "ok": True, "status": "passed",
            "reason": "approved by policy"} in body["steps"]  # fmt: skip
    assert [s["step"] for s in body["steps"]] == list(STEPS)
    args = json.loads((tmp_path / "attest-args.json").read_text())
    assert args == ["p0", pair.prefill.url]  # Narwhal appends the engine id and URL
    assert (await admin.engine("p0"))["holds"] == []


@pytest.mark.parametrize(
    ("exit_code", "stdout", "sleep_s", "reason"),
    [
        (3, "not json at all\n", 0.0, "not json at all"),
        (2, "", 0.0, "command exited 2"),
        (0, "", 3.0, "attestation command timed out after 0.5s"),
    ],
    ids=["plain-text-reason", "silent-failure", "timeout"],
)
async def test_command_attestation_other_failures(
    pair: Pair, start_router: StartRouter, http: aiohttp.ClientSession, tmp_path: Path,
    exit_code: int, stdout: str, sleep_s: float, reason: str,
) -> None:  # fmt: skip
    command = attest_script(tmp_path, exit_code, stdout, sleep_s)
    _, admin = await drained(
        start_router, http, pd(pair.prefill.url, pair.decode.url),
        attestation={"kind": "command", "command": command, "timeout_s": 0.5},
    )  # fmt: skip
    last = await refused(admin, "p0", "attestation", reason)
    assert last["reason"] == reason


# --------------------------------------------------------------------------------------------
# attestation: tls (a router process that trusts the engine's CA for its own HTTPS client, so
# health passes and only the attestation CA decides)


@pytest.fixture
async def tls_front(pair: Pair) -> AsyncIterator[list[EngineFront]]:
    fronts: list[EngineFront] = []
    yield fronts
    for front in fronts:
        await front.close()


@pytest.fixture
async def router_process() -> AsyncIterator[list[RouterProcess]]:
    procs: list[RouterProcess] = []
    yield procs
    for proc in procs:
        await proc.stop()


async def tls_router(
    pair: Pair, pki: Pki, tmp_path: Path, fronts: list[EngineFront], procs: list[RouterProcess],
    *, served_by: str, names: list[str], attest_ca: str, client_trusts: str,
) -> tuple[Admin, aiohttp.ClientSession]:  # fmt: skip
    cert, key = pki.issue(served_by, f"{served_by}-{'-'.join(names)}", names, ["127.0.0.1"])
    front = await EngineFront(pair.prefill.url, Pki.server_context(cert, key)).start()
    fronts.append(front)
    config = router_config(
        pd(front.url, pair.decode.url), tmp_path,
        admin={"token": TOKEN}, recovery=STAY,
        attestation={"kind": "tls", "ca_file": str(pki.dir / f"{attest_ca}.pem")},
    )  # fmt: skip
    env = {"SSL_CERT_FILE": str(pki.dir / f"{client_trusts}.pem")}
    proc = await RouterProcess(config, tmp_path, env).start()
    procs.append(proc)
    session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))
    admin = Admin(session, proc.url)
    await admin.wait_engine("p0", lambda e: e["generation"] is not None, "generation over https")
    await admin.drain("p0")
    return admin, session


@pytest.fixture(scope="module")
def cas(pki: Pki) -> Pki:
    pki.ca("ca-a")
    pki.ca("ca-b")
    return pki


@pytest.mark.slow
async def test_tls_attestation_refuses_a_certificate_from_another_ca(
    pair: Pair, cas: Pki, tmp_path: Path, tls_front: list[EngineFront],
    router_process: list[RouterProcess],
) -> None:  # fmt: skip
    admin, session = await tls_router(
        pair, cas, tmp_path, tls_front, router_process,
        served_by="ca-b", names=["p0"], attest_ca="ca-a", client_trusts="ca-b",
    )  # fmt: skip
    async with session:
        last = await refused(admin, "p0", "attestation", "certificate rejected")
        assert "issuer" in last["reason"], last  # unable to get local issuer certificate


@pytest.mark.slow
async def test_tls_attestation_refuses_a_certificate_naming_another_engine(
    pair: Pair, cas: Pki, tmp_path: Path, tls_front: list[EngineFront],
    router_process: list[RouterProcess],
) -> None:  # fmt: skip
    admin, session = await tls_router(
        pair, cas, tmp_path, tls_front, router_process,
        served_by="ca-a", names=["p1"], attest_ca="ca-a", client_trusts="ca-a",
    )  # fmt: skip
    async with session:
        last = await refused(admin, "p0", "attestation", "certificate rejected")
        assert "p0" in last["reason"], last  # hostname mismatch ... not valid for 'p0'


@pytest.mark.slow
async def test_tls_attestation_passes_a_certificate_from_the_ca_naming_the_engine(
    pair: Pair, cas: Pki, tmp_path: Path, tls_front: list[EngineFront],
    router_process: list[RouterProcess],
) -> None:  # fmt: skip
    admin, session = await tls_router(
        pair, cas, tmp_path, tls_front, router_process,
        served_by="ca-a", names=["p0"], attest_ca="ca-a", client_trusts="ca-a",
    )  # fmt: skip
    async with session:
        status, body = await admin.readmit("p0")
        assert status == 200, body
        assert [s["step"] for s in body["steps"]] == list(STEPS)
        assert {"step": "attestation", "ok": True, "status": "passed",
                "reason": "certificate chains to the CA and names p0"} in body["steps"]  # fmt: skip
        assert (await admin.engine("p0"))["holds"] == []


async def test_tls_attestation_refuses_a_plain_http_engine(
    pair: Pair, cas: Pki, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    _, admin = await drained(
        start_router, http, pd(pair.prefill.url, pair.decode.url),
        attestation={"kind": "tls", "ca_file": str(cas.dir / "ca-a.pem")},
    )  # fmt: skip
    await refused(admin, "p0", "attestation", "tls attestation needs an https engine url")


# --------------------------------------------------------------------------------------------
# model identity


@pytest.mark.slow
async def test_model_identity_fails_for_an_engine_serving_another_model(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    prefill, decode = sim_factory.start_many([[*PREFILL, "--model", "other"], list(DECODE)])
    _, admin = await drained(start_router, http, pd(prefill.url, decode.url))
    await refused(admin, "p0", "model_identity", "serves ['other'], not 'demo-model'")


@pytest.mark.slow
async def test_model_identity_fails_when_the_engine_starts_reporting_another_model(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    prefill, decode = sim_factory.start_many([list(PREFILL), list(DECODE)])
    _, admin = await drained(start_router, http, pd(prefill.url, decode.url))
    await asyncio.to_thread(prefill.add_fault, {"kind": "wrong_model", "model": "llama-x"})
    await refused(admin, "p0", "model_identity", "serves ['llama-x'], not 'demo-model'")
    await asyncio.to_thread(prefill.clear_faults)
    status, body = await admin.readmit("p0")
    assert status == 200 and body["readmitted"] is True, body


# --------------------------------------------------------------------------------------------
# generation identity


@pytest.mark.slow
async def test_generation_identity_fails_for_an_older_process_on_the_engine_url(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    older = sim_factory(*PREFILL)  # started first: the older process generation
    newer, decode = sim_factory.start_many([list(PREFILL), list(DECODE)])
    old_gen, new_gen = older.process_start_time(), newer.process_start_time()
    assert old_gen < new_gen
    front = await EngineFront(newer.url).start()
    try:
        _, admin = await drained(start_router, http, pd(front.url, decode.url))
        assert (await admin.engine("p0"))["generation"] == new_gen
        front.upstream = older.url  # the URL now reaches an older process
        last = await refused(admin, "p0", "generation_identity", "older than last seen")
        assert str(old_gen) in last["reason"] and str(new_gen) in last["reason"], last
        assert (await admin.engine("p0"))["generation"] == new_gen  # not overwritten
        front.upstream = newer.url
        status, body = await admin.readmit("p0")
        assert status == 200 and body["readmitted"] is True, body
    finally:
        await front.close()


# --------------------------------------------------------------------------------------------
# role-permitted KV transfer (declared and functional)


@pytest.mark.slow
async def test_kv_transfer_fails_for_a_prefill_engine_that_cannot_produce_a_handoff(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    # Declared kv_producer (config accepts prefill), but the process is a kv_consumer: its
    # prefill leg answers without a handoff. Only the functional check can catch it.
    consumer, good, decode = sim_factory.start_many(
        [["--role", "prefill", "--kv-role", "kv_consumer"], list(PREFILL), list(DECODE)]
    )
    engines = [
        engine("p0", consumer.url, "prefill", kv_role="kv_producer"),
        engine("p1", good.url, "prefill"),
        engine("d0", decode.url, "decode"),
    ]
    _, admin = await drained(start_router, http, engines)
    last = await refused(admin, "p0", "kv_transfer", "kv_transfer_params")
    assert "handoff" in last["reason"] or "kv_handoff" in last["reason"], last


@pytest.mark.slow
async def test_kv_transfer_fails_for_a_decode_engine_that_cannot_consume_a_handoff(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    producer, prefill, good = sim_factory.start_many(
        [["--role", "decode", "--kv-role", "kv_producer"], list(PREFILL), list(DECODE)]
    )
    engines = [
        engine("p0", prefill.url, "prefill"),
        engine("d0", producer.url, "decode", kv_role="kv_consumer"),
        engine("d1", good.url, "decode"),
    ]
    _, admin = await drained(start_router, http, engines, target="d0")
    await refused(admin, "d0", "kv_transfer", "HTTP 500")


# --------------------------------------------------------------------------------------------
# final health


@pytest.mark.slow
async def test_final_health_fails_when_health_breaks_after_the_first_check(
    sim_factory: SimFactory, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    prefill, decode = sim_factory.start_many([list(PREFILL), list(DECODE)])
    front = await EngineFront(prefill.url).start()
    try:
        _, admin = await drained(start_router, http, pd(front.url, decode.url))

        async def break_health() -> None:  # runs when generation_identity reads /metrics
            await asyncio.to_thread(prefill.add_fault, {"kind": "health_status", "status": 503})

        front.before["/metrics"] = break_health
        last = await refused(admin, "p0", "final_health", "health answered HTTP 503")
        _, body = await admin.readmit("p0")
        assert body["steps"][0]["step"] == "health" and not body["steps"][0]["ok"]
        assert last["step"] == "final_health"
        await asyncio.to_thread(prefill.clear_faults)
        status, body = await admin.readmit("p0")
        assert status == 200 and body["readmitted"] is True, body
        first = body["steps"][0]
        assert first == {"step": "health", "ok": True, "status": "passed", "reason": "health 200"}
    finally:
        await front.close()
