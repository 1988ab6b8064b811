"""Discovery (DESIGN §10, issue 19): engines found in DNS, served by a real `dnsmasq`, and in a
watched file, over real `narwhal-sim` engines.

DNS: SRV records as a Kubernetes headless Service gives a StatefulSet (a stable host name per
pod); pods added, removed after `discovery.grace_s` (never ejected), the same name at a new
address (relocated); A records when the name has no SRV records; a DNS server that does not
answer changes nothing. A Service with two ports (HTTP and the NIXL side channel) answers SRV
for both under its plain name: each pod is one engine on its HTTP port, by the source's
`port` or the named port's `_http._tcp.` name, stable across rounds; without either, the
answer is refused. File: engines added, changed and removed by editing it, and a file
that does not validate changes nothing.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from tests.support.dnsmasq import Dnsmasq, dnsmasq
from tests.support.http import metric, metric_sum
from tests.support.poll import eventually
from tests.support.ports import free_port
from tests.support.router import RunningRouter, StartRouter
from tests.support.sim_process import SimFactory, SimProcess

pytestmark = pytest.mark.slow

SRV = "_vllm._tcp.decode.test"
GRACE_S = 1.0
D = ["--role", "decode", "--kv-role", "kv_consumer"]


@pytest.fixture
def dns(tmp_path: Path) -> Iterator[Dnsmasq]:
    with dnsmasq(tmp_path) as server:
        yield server


@pytest.fixture
def sims() -> Iterator[list[SimProcess]]:
    """p0 (configured), then three decodes for DNS to name."""
    factory = SimFactory()
    try:
        yield factory.start_many([["--role", "prefill", "--kv-role", "kv_producer"], D, D, D])
    finally:
        factory.close()


def _discovery(**sources: Any) -> dict[str, Any]:
    return {"interval_s": 0.1, "grace_s": GRACE_S, "timeout_s": 0.3, **sources}


async def _router(
    start_router: StartRouter, prefill: SimProcess, discovery: dict[str, Any]
) -> RunningRouter:
    return await start_router(
        [{"id": "p0", "url": prefill.url, "role": "prefill"}],
        discovery=discovery,
        controller={"monitor_interval_s": 0.1},
    )


async def _engines(http: aiohttp.ClientSession, rr: RunningRouter) -> dict[str, Any]:
    async with http.get(rr.url + "/admin/engines") as resp:
        return {e["id"]: e for e in (await resp.json())["engines"]}


async def _until(http: aiohttp.ClientSession, rr: RunningRouter, want: dict[str, str]) -> None:
    """Until the members are exactly `want` (id -> url), each of them eligible."""

    async def settled() -> bool:
        engines = await _engines(http, rr)
        return {i: e["url"] for i, e in engines.items()} == want and all(
            e["eligible"] for e in engines.values()
        )

    await eventually(settled, timeout_s=10, what=f"members {sorted(want)}")


async def _complete(http: aiohttp.ClientSession, rr: RunningRouter) -> None:
    body = {"model": "demo-model", "prompt": "found by DNS", "max_tokens": 4}
    async with http.post(rr.url + "/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()


async def test_srv_pods_join_move_and_leave_after_the_grace_period(
    dns: Dnsmasq, sims: list[SimProcess], start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    a, b, c = sims[1:]
    hosts = {"d0.decode.test": ["127.0.0.1"], "d1.decode.test": ["127.0.0.1"]}
    dns.serve({SRV: [("d0.decode.test", a.port), ("d1.decode.test", b.port)]}, hosts)
    source = {"name": SRV, "role": "decode", "kv_role": "kv_consumer"}
    rr = await _router(
        start_router, sims[0], _discovery(nameservers=[dns.nameserver], dns=[source])
    )
    p0 = {"p0": sims[0].url}
    await _until(http, rr, {**p0, "d0.decode.test": a.url, "d1.decode.test": b.url})
    await _complete(http, rr)

    # The pod d1 is rescheduled: the same name at a new address.
    dns.serve({SRV: [("d0.decode.test", a.port), ("d1.decode.test", c.port)]}, hosts)
    await _until(http, rr, {**p0, "d0.decode.test": a.url, "d1.decode.test": c.url})

    # The pod d0 is gone: kept for the grace period, then drained and removed.
    dns.serve({SRV: [("d1.decode.test", c.port)]}, hosts)
    gone_from_dns = time.monotonic()
    await _until(http, rr, {**p0, "d1.decode.test": c.url})
    assert time.monotonic() - gone_from_dns >= GRACE_S
    await _complete(http, rr)

    async with http.get(rr.url + "/metrics") as resp:
        text = await resp.text()
    changes = "narwhal_membership_changes_total"
    assert metric_sum(text, changes, change="added", source="dns") == 2
    assert metric_sum(text, changes, change="relocated", source="dns") == 1
    assert metric_sum(text, changes, change="removed", source="dns") == 1
    assert metric_sum(text, "narwhal_ejections_total") == 0
    assert metric_sum(text, "narwhal_discovered_engines", source="dns") == 1


async def test_a_dns_server_that_does_not_answer_changes_nothing(
    dns: Dnsmasq, sims: list[SimProcess], start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    a = sims[1]
    dns.serve({SRV: [("d0.decode.test", a.port)]}, {"d0.decode.test": ["127.0.0.1"]})
    source = {"name": SRV, "role": "decode"}
    rr = await _router(
        start_router, sims[0], _discovery(nameservers=[dns.nameserver], dns=[source])
    )
    want = {"p0": sims[0].url, "d0.decode.test": a.url}
    await _until(http, rr, want)
    dns.stop()
    failed = await metric(http, rr.url, "narwhal_discovery_rounds_total", result="failed")
    stopped = time.monotonic()

    async def failing_past_the_grace() -> bool:
        n = await metric(http, rr.url, "narwhal_discovery_rounds_total", result="failed")
        return n > failed + 2 and time.monotonic() - stopped > GRACE_S * 1.5

    await eventually(failing_past_the_grace, timeout_s=10, what="rounds failing")
    await _until(http, rr, want)  # still there, long past the grace period
    await _complete(http, rr)


async def test_a_name_without_srv_records_gives_one_engine_per_address(
    dns: Dnsmasq, start_router: StartRouter, http: aiohttp.ClientSession
) -> None:
    """A/AAAA records and the source's port: two decodes on two loopback addresses."""
    port = free_port()
    started: list[SimProcess] = []
    try:
        for host in ("127.0.0.2", "127.0.0.3"):
            started.append(SimProcess(*D, host=host, port=port).start())
        started.append(SimProcess("--role", "prefill", "--kv-role", "kv_producer").start())
        first, second, prefill = started
        dns.serve({}, {"pool.decode.test": ["127.0.0.2", "127.0.0.3"]})
        source = {"name": "pool.decode.test", "port": port, "role": "decode"}
        rr = await _router(
            start_router, prefill, _discovery(nameservers=[dns.nameserver], dns=[source])
        )
        want = {"p0": prefill.url, "127.0.0.2": first.url, "127.0.0.3": second.url}
        await _until(http, rr, want)
        await _complete(http, rr)
    finally:
        for sim in started:
            sim.close()


@pytest.fixture
def two_port_pods(dns: Dnsmasq) -> Iterator[tuple[SimProcess, dict[str, SimProcess]]]:
    """A prefill, and two decode pods of a Service with an `http` and a `nixl` port, as
    Kubernetes DNS answers for it: the plain name has both ports of each pod (the side
    channel's first for one of them), `_http._tcp.` and `_nixl._tcp.` one each. The pods
    share their HTTP port on two loopback addresses, as a StatefulSet's pods do; nothing
    answers HTTP on the side-channel port."""
    http_port, nixl_port = free_port(), free_port()
    started: list[SimProcess] = []
    try:
        pods = {}
        for name, host in (("d0.decode.test", "127.0.0.2"), ("d1.decode.test", "127.0.0.3")):
            pods[name] = SimProcess(*D, host=host, port=http_port).start()
            started.append(pods[name])
        prefill = SimProcess("--role", "prefill", "--kv-role", "kv_producer").start()
        started.append(prefill)
        dns.serve(
            {
                "decode.test": [
                    ("d0.decode.test", nixl_port),
                    ("d0.decode.test", http_port),
                    ("d1.decode.test", http_port),
                    ("d1.decode.test", nixl_port),
                ],
                "_http._tcp.decode.test": [(n, http_port) for n in pods],
                "_nixl._tcp.decode.test": [(n, nixl_port) for n in pods],
            },
            {"d0.decode.test": ["127.0.0.2"], "d1.decode.test": ["127.0.0.3"]},
        )
        yield prefill, pods
    finally:
        for sim in started:
            sim.close()


@pytest.mark.parametrize("by", ["port", "named-port"])
async def test_a_two_port_service_gives_one_engine_per_pod_on_its_http_port(
    by: str,
    dns: Dnsmasq,
    two_port_pods: tuple[SimProcess, dict[str, SimProcess]],
    start_router: StartRouter,
    http: aiohttp.ClientSession,
) -> None:
    prefill, pods = two_port_pods
    http_port = int(pods["d0.decode.test"].url.rsplit(":", 1)[1])
    source: dict[str, Any] = {"role": "decode", "kv_role": "kv_consumer"}
    if by == "port":
        source.update(name="decode.test", port=http_port)
    else:
        source.update(name="_http._tcp.decode.test")
    rr = await _router(
        start_router, prefill, _discovery(nameservers=[dns.nameserver], dns=[source])
    )
    want = {"p0": prefill.url, **{name: sim.url for name, sim in pods.items()}}
    await _until(http, rr, want)
    await _complete(http, rr)

    # Stable across rounds: never relocated to the side channel and back, never removed.
    rounds = "narwhal_discovery_rounds_total"
    seen = await metric(http, rr.url, rounds, source="dns", result="ok")

    async def five_more_rounds() -> bool:
        return await metric(http, rr.url, rounds, source="dns", result="ok") >= seen + 5

    await eventually(five_more_rounds, timeout_s=10, what="five more DNS rounds")
    await _until(http, rr, want)
    async with http.get(rr.url + "/metrics") as resp:
        text = await resp.text()
    changes = "narwhal_membership_changes_total"
    assert metric_sum(text, changes, change="added", source="dns") == 2
    assert metric_sum(text, changes, change="relocated", source="dns") == 0
    assert metric_sum(text, changes, change="removed", source="dns") == 0
    assert metric_sum(text, "narwhal_discovered_engines", source="dns") == 2
    assert metric_sum(text, rounds, source="dns", result="failed") == 0


async def test_a_two_port_service_without_a_port_to_choose_is_refused(
    dns: Dnsmasq,
    two_port_pods: tuple[SimProcess, dict[str, SimProcess]],
    start_router: StartRouter,
    http: aiohttp.ClientSession,
) -> None:
    """The plain name and no `port`: each pod has two ports, and which one serves HTTP is
    not guessed. The round fails (logged and counted) and adds nothing."""
    prefill, _ = two_port_pods
    source = {"name": "decode.test", "role": "decode"}
    rr = await _router(
        start_router, prefill, _discovery(nameservers=[dns.nameserver], dns=[source])
    )
    rounds = "narwhal_discovery_rounds_total"

    async def refused() -> bool:
        return await metric(http, rr.url, rounds, source="dns", result="failed") >= 3

    await eventually(refused, timeout_s=10, what="the ambiguous answer refused")
    assert set(await _engines(http, rr)) == {"p0"}
    assert rr.router.discovery is not None
    error = rr.router.discovery.errors["dns"] or ""
    assert "has ports" in error and "_http._tcp." in error, error


async def test_a_watched_file_adds_changes_and_removes_engines(
    sims: list[SimProcess], start_router: StartRouter, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    a, b, c = sims[1:]
    path = tmp_path / "engines.yaml"
    path.write_text(yaml.safe_dump([{"id": "fa", "url": a.url, "role": "decode"}]))
    rr = await _router(start_router, sims[0], _discovery(file=str(path)))
    p0 = {"p0": sims[0].url}
    await _until(http, rr, {**p0, "fa": a.url})

    # Prometheus file_sd groups, and a JSON file is YAML too.
    group = {"targets": [b.url.removeprefix("http://")], "labels": {"role": "decode"}}
    path.write_text(yaml.safe_dump([group, {"id": "fa", "url": c.url, "role": "decode"}]))
    sd_id = b.url.removeprefix("http://").replace(":", "-")
    await _until(http, rr, {**p0, "fa": c.url, sd_id: b.url})

    # A file that does not validate changes nothing (and says why in a metric and the log).
    path.write_text(yaml.safe_dump([{"id": "fa", "url": c.url, "role": "sideways"}]))
    failed = "narwhal_discovery_rounds_total"

    async def refused() -> bool:
        return await metric(http, rr.url, failed, source="file", result="failed") >= 2

    await eventually(refused, timeout_s=10, what="the bad file refused")
    await _until(http, rr, {**p0, "fa": c.url, sd_id: b.url})

    path.write_text("[]\n")
    await _until(http, rr, p0)
    await _complete_fails_without_decode(http, rr)


async def _complete_fails_without_decode(http: aiohttp.ClientSession, rr: RunningRouter) -> None:
    body = {"model": "demo-model", "prompt": "no decode left", "max_tokens": 4}
    async with http.post(rr.url + "/v1/completions", json=body) as resp:
        assert resp.status == 503
    async with http.get(rr.url + "/ready") as resp:
        assert resp.status == 503 and "decode" in await resp.text()


async def test_resume_judges_the_engine_set_with_the_first_rounds_answer(
    sims: list[SimProcess], start_router: StartRouter, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    """With discovery, the configured fleet is the config's engines and the first round's
    answer: a restart with `--resume` over the same file applies the saved handoff."""
    path = tmp_path / "engines.yaml"
    path.write_text(yaml.safe_dump([{"id": "fa", "url": sims[1].url, "role": "decode"}]))
    first = await _router(start_router, sims[0], _discovery(file=str(path)))
    await _until(http, first, {"p0": sims[0].url, "fa": sims[1].url})
    async with http.post(first.url + "/admin/engines/fa/drain") as resp:
        assert resp.status == 200

    async def saved() -> bool:
        doc = first.router.handoff.last_document
        return doc is not None and bool(doc["engines"]["fa"]["holds"])

    await eventually(saved, timeout_s=5, what="the drain in the handoff")
    await first.stop()
    second = await start_router(
        [{"id": "p0", "url": sims[0].url, "role": "prefill"}],
        discovery=_discovery(file=str(path)),
        controller={"monitor_interval_s": 0.1},
        router_kwargs={"resume": True},
    )
    verdict = second.router.resume_verdict
    assert verdict is not None and verdict.ok, verdict
    engines = await _engines(http, second)
    assert engines["fa"]["holds"] == ["operator_drain"]  # carried over by the resume
