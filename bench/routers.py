"""The routers under test: how each is configured, started and recognised as ready.

Every router listens on 127.0.0.1, logs at warning level (per-request logging would be measured
otherwise), and is given the same request deadline. Beyond that, peers run with their defaults,
or with their health-check interval tuned to Narwhal's monitor interval (`-hc1` variants).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from bench import web
from bench.procs import Proc, free_port, spawn
from bench.venv import BenchVenv

REPO = Path(__file__).resolve().parents[1]
BOOTSTRAP_PORT = "8998"  # SGLang's KV bootstrap port: announced to engines, never used by the sim
# A Narwhal with `api_key` (router_bound's `narwhal-w<N>-auth`) reads its client keys from this
# variable (`auth.api_keys_env`), set for its process alone; the load generator sends the key.
API_KEYS_ENV = "NARWHAL_BENCH_API_KEYS"
BENCH_API_KEY = "sk-narwhal-bench-0123456789abcdef0123456789abcdef"  # loopback only, not a secret


@dataclass(frozen=True, slots=True)
class RouterSpec:
    """A router variant. `kind` is narwhal, vllm-router, sglang-router, floor, floor-raw,
    floor-granian, oracle (bench.oracle, the `cache` suite's) or direct. `uvloop`: Narwhal
    or a floor started through `bench.uvrun` (floor-raw always is). `workers`: Narwhal's
    `serving.workers` (an int or "auto"); None leaves Narwhal's default. `api_key`: Narwhal
    requires this client key on every `/v1` request (`auth.api_keys_env: API_KEYS_ENV`, the
    variable set to it for the router's process), and the load generator sends it as
    `Authorization: Bearer <key>` to this router only; None: no auth."""

    name: str
    kind: str
    policy: str = "single_attempt"
    health_interval_s: float | None = None  # peers: None keeps the default
    narwhal: dict[str, Any] = field(default_factory=dict)  # extra Narwhal config sections
    snapshots: Path | None = None  # Narwhal under tracemalloc, snapshots here (bench.traced)
    uvloop: bool = False
    workers: int | str | None = None
    src: Path | None = None  # Narwhal from this source tree (`--ab-src`) instead of the repo's
    api_key: str | None = None
    # Narwhal: each prefill engine's `kv_events` (from `Engines.kv_events`) in its config
    kv_events: bool = False
    peer_policy: str | None = None  # a peer's `--policy` (None: its default)
    peer_args: tuple[str, ...] = ()  # more flags for a peer (the `flow` suite's queue limits)
    engine_max_concurrency: int | None = None  # Narwhal: every engine's `max_concurrency`


@dataclass(slots=True)
class Running:
    spec: RouterSpec
    url: str
    proc: Proc | None
    argv: list[str] = field(default_factory=list)
    config: dict[str, Any] | None = None  # Narwhal's YAML, as a dict

    async def stop(self) -> None:
        if self.proc is not None:
            await self.proc.stop()


@dataclass(frozen=True, slots=True)
class Engines:
    model: str
    prefill: list[str]
    decode: list[str]
    # prefill URL -> its KV-event publisher (`endpoint`, `replay_endpoint`, `topic`)
    kv_events: dict[str, dict[str, str]] = field(default_factory=dict)


def narwhal_config(spec: RouterSpec, engines: Engines, port: int, state: Path) -> dict[str, Any]:
    listed: list[dict[str, Any]] = [
        {"id": f"p{i}", "url": u, "role": "prefill"} for i, u in enumerate(engines.prefill)
    ] + [{"id": f"d{i}", "url": u, "role": "decode"} for i, u in enumerate(engines.decode)]
    if spec.kv_events:
        for entry in listed:
            if entry["url"] in engines.kv_events:
                entry["kv_events"] = engines.kv_events[entry["url"]]
    if spec.engine_max_concurrency is not None:
        for entry in listed:
            entry["max_concurrency"] = spec.engine_max_concurrency
    serving: dict[str, Any] = {"policy": spec.policy}
    if spec.workers is not None:
        serving["workers"] = spec.workers  # data-plane worker processes (DESIGN §9)
    config: dict[str, Any] = {
        "router_id": f"bench-{spec.name}",
        "listen": f"127.0.0.1:{port}",
        "model": engines.model,
        "engines": listed,
        "serving": serving,
        "handoff": {"path": str(state / "handoff.json")},
        "lease": {"backend": "none"},
        # Placed by load unless a target says otherwise: the default (`prefix`) is measured
        # as its own target (`-prefix`, and the cache suite's arms), beside plain placement.
        "placement": {"policy": "least_loaded"},
    }
    if spec.api_key is not None:
        config["auth"] = {"api_keys_env": API_KEYS_ENV}  # the key itself only in the env
    for section, values in spec.narwhal.items():
        config[section] = {**config.get(section, {}), **values}
    return config


async def start_router(
    spec: RouterSpec,
    engines: Engines,
    work: Path,
    venv: BenchVenv | None,
    request_timeout_s: float,
) -> Running:
    """Start a router on a free port; a port taken in the meantime is retried on another."""
    if spec.kind == "direct":
        return Running(spec, "", None)
    for attempt in range(3):
        try:
            return await _start(spec, engines, work, venv, request_timeout_s, free_port())
        except RuntimeError as exc:
            log = (work / "logs" / f"{spec.name}.log").read_text(errors="replace")[-4000:]
            if attempt == 2 or "in use" not in log.lower():
                raise RuntimeError(f"{exc}; log tail: {log[-600:]}") from None
    raise AssertionError("unreachable")


async def _start(
    spec: RouterSpec,
    engines: Engines,
    work: Path,
    venv: BenchVenv | None,
    request_timeout_s: float,
    port: int,
) -> Running:
    url = f"http://127.0.0.1:{port}"
    log_dir = work / "logs"
    config: dict[str, Any] | None = None
    env: dict[str, str] = {}
    if spec.kind in ("floor", "floor-raw"):
        module = "bench.floor" if spec.kind == "floor" else "bench.floor_raw"
        argv = [sys.executable, *_launch(spec, module), "--port", str(port)]
        argv += ["--prefill", engines.prefill[0]]
        for u in engines.decode:
            argv += ["--decode", u]
        ready = "/health"
    elif spec.kind == "oracle":
        argv = [sys.executable, "-m", "bench.oracle", "--port", str(port)]
        for u in engines.prefill:
            argv += ["--prefill", u]
        for u in engines.decode:
            argv += ["--decode", u]
        ready = "/health"
    elif spec.kind == "floor-granian":
        if venv is None or not venv.has("granian"):
            raise RuntimeError(f"{spec.name}: the bench virtualenv has no granian")
        argv = granian_argv(venv, port)
        env = {"FLOOR_PREFILL": engines.prefill[0], "FLOOR_DECODE": ",".join(engines.decode)}
        ready = "/health"
    elif spec.kind == "narwhal":
        config = narwhal_config(spec, engines, port, work / "state" / spec.name)
        config["serving"].setdefault("request_timeout_s", request_timeout_s)
        path = _write_config(work / "state" / spec.name, config)
        argv = [sys.executable, *_launch(spec, "narwhal.cli.serve"), "--config", str(path)]
        if spec.snapshots is not None:
            argv[1:3] = ["-m", "bench.traced", str(spec.snapshots)]
        argv += ["--log-level", "WARNING"]
        if spec.src is not None:  # ahead of the editable install; the workers inherit it
            env["PYTHONPATH"] = str(spec.src)
        if spec.api_key is not None:  # the workers inherit it too
            env[API_KEYS_ENV] = spec.api_key
        ready = "/ready"
    else:
        if venv is None or not venv.ready:
            raise RuntimeError(f"{spec.name}: the bench virtualenv is not available")
        argv = peer_argv(spec, engines, port, venv, request_timeout_s)
        ready = "/health"
    proc, _ = await spawn(spec.name, argv, log_dir, env=env)
    try:
        await web.wait_until(url + ready, timeout_s=60, alive=lambda: proc.alive)
    except BaseException:
        await proc.stop()
        raise
    return Running(spec, url, proc, argv, config)


def granian_argv(venv: BenchVenv, port: int) -> list[str]:
    """bench.floor_granian under granian: one worker, its event loop on uvloop."""
    argv = [str(venv.bin / "granian"), "--interface", "rsgi", "--host", "127.0.0.1"]
    argv += ["--port", str(port), "--workers", "1", "--loop", "uvloop", "--no-ws"]
    argv += ["--log-level", "warning", "--no-access-log", "--working-dir", str(REPO)]
    return [*argv, "bench.floor_granian:app"]


def _launch(spec: RouterSpec, module: str) -> list[str]:
    """`-m MODULE`, or `-m bench.uvrun MODULE` to run it on uvloop."""
    if spec.uvloop or spec.kind == "floor-raw":
        return ["-m", "bench.uvrun", module]
    return ["-m", module]


def _write_config(state: Path, config: dict[str, Any]) -> Path:
    state.mkdir(parents=True, exist_ok=True)
    path = state / "narwhal.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def peer_argv(
    spec: RouterSpec, engines: Engines, port: int, venv: BenchVenv, request_timeout_s: float
) -> list[str]:
    if spec.kind == "vllm-router":
        argv = [str(venv.bin / "vllm-router"), "--vllm-pd-disaggregation"]
        for u in engines.prefill:
            argv += ["--prefill", u]
        log_level = "warning"
    elif spec.kind == "sglang-router":
        argv = [str(venv.python), "-m", "sglang_router.launch_router", "--pd-disaggregation"]
        for u in engines.prefill:
            argv += ["--prefill", u, BOOTSTRAP_PORT]
        log_level = "warn"
    else:
        raise ValueError(f"unknown router kind {spec.kind}")
    for u in engines.decode:
        argv += ["--decode", u]
    argv += ["--host", "127.0.0.1", "--port", str(port)]
    argv += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
    argv += ["--request-timeout-secs", str(int(request_timeout_s))]
    argv += ["--log-level", log_level]
    if spec.health_interval_s is not None:
        argv += ["--health-check-interval-secs", str(int(spec.health_interval_s))]
    if spec.peer_policy is not None:
        argv += ["--policy", spec.peer_policy]
    return [*argv, *spec.peer_args]
