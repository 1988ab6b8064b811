"""What every suite shares: the work directory, the bench virtualenv, the load generator."""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from bench.loadgen.driver import LoadGen
from bench.modes import Mode
from bench.routers import BENCH_API_KEY, RouterSpec
from bench.venv import BenchVenv

PEER_KINDS = ("vllm-router", "sglang-router")
REQUEST_TIMEOUT_S = 10.0  # every router's request deadline; the client gives up 2 s later
CLIENT_GRACE_S = 2.0
# `narwhal-w<N>[-<variant>]`: plain, or its router_bound twins (bounded policy, client keys,
# access log, cache-aware placement, flow control)
NARWHAL_VARIANTS = ("", "bounded", "auth", "access", "prefix", "flow")


def router_spec(name: str, model: str | None = None) -> RouterSpec:
    """`narwhal`, `narwhal-bounded`, `vllm-router[-hc1]`, `sglang-router[-hc1]`, `floor`
    (bench.floor: the HTTP stack's own cost), `direct`; `narwhal-uvloop` and `floor-uvloop`
    (the same on uvloop), `floor-raw` (bench.floor_raw: the floor on asyncio protocols,
    httptools and uvloop), `floor-granian` (bench.floor_granian: granian serving);
    `narwhal-w<N>` and `narwhal-wauto`: Narwhal with `serving.workers` N or auto;
    `narwhal-w<N>-bounded`, `narwhal-wauto-bounded`: the same under `serving.policy: bounded`;
    `narwhal-w<N>-auth`: the same with client keys (`auth.api_keys_env`, the load generator
    sending the key), `narwhal-w<N>-access`: with the access log (`logging.access: true`)
    `narwhal-w<N>-prefix`: placing by prefix (`placement.policy: prefix`), with `model`
    (the bench tokenizer's directory, the served model's name) as its tokenizer, and
    `narwhal-w<N>-flow`: with flow control on (`flow.enabled: true`)."""
    if name in ("direct", "floor", "floor-raw", "floor-granian"):
        return RouterSpec(name, name)
    if name.startswith("narwhal-w"):
        count, _, variant = name.removeprefix("narwhal-w").partition("-")
        if variant not in NARWHAL_VARIANTS:
            raise ValueError(f"{name}: not a Narwhal target (-{variant}?)")
        workers: int | str = count if count == "auto" else int(count)
        spec = RouterSpec(name, "narwhal", workers=workers)
        if variant == "bounded":
            return replace(spec, policy="bounded")
        if variant == "auth":
            return replace(spec, api_key=BENCH_API_KEY)
        if variant == "access":
            return replace(spec, narwhal={"logging": {"access": True}})
        if variant == "prefix":
            placement: dict[str, Any] = {"policy": "prefix"}
            if model is not None:
                placement["tokenizers"] = {model: model}
            return replace(spec, narwhal={"placement": placement})
        if variant == "flow":
            return replace(spec, narwhal={"flow": {"enabled": True}})
        return spec
    if name == "floor-uvloop":
        return RouterSpec(name, "floor", uvloop=True)
    if name.startswith("narwhal"):
        policy = "bounded" if name.endswith("bounded") else "single_attempt"
        return RouterSpec(name, "narwhal", policy=policy, uvloop=name.endswith("-uvloop"))
    kind = name.removesuffix("-hc1")
    return RouterSpec(name, kind, health_interval_s=1.0 if name.endswith("-hc1") else None)


@dataclass(slots=True)
class Context:
    mode: Mode
    work: Path
    venv: BenchVenv
    loadgen: LoadGen
    model: str
    skipped: dict[str, str] = field(default_factory=dict)  # router kind -> why it cannot run
    notes: list[str] = field(default_factory=list)
    commands: dict[str, str] = field(default_factory=dict)  # router name -> command line
    configs: dict[str, Any] = field(default_factory=dict)  # Narwhal variant -> its config
    # `--ab-src`: router_bound also runs each Narwhal target from this source tree (another
    # revision's `src/`, e.g. a git worktree), as `<target>@base`, for a side-by-side A/B
    ab_src: Path | None = None

    @property
    def logs(self) -> Path:
        return self.work / "logs"

    def available(self, name: str) -> bool:
        return router_spec(name).kind not in self.skipped

    def log(self, message: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def load_python(venv: BenchVenv) -> str:
    """The load generator runs in the bench venv (uvloop) when it has aiohttp and uvloop."""
    if venv.has("aiohttp") and venv.has("uvloop"):
        return str(venv.python)
    return sys.executable


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def jsonable(value: Any) -> Any:
    """Round floats for the results file."""
    if isinstance(value, float):
        return round(value, 6)
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    return value
