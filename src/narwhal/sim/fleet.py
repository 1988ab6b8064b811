"""`narwhal-sim fleet`: N prefill and M decode engines as child processes, stopped together.

Prefill engines listen on base_port, base_port+1, ...; decode engines on base_port+100, ....
SIGTERM or SIGINT stops every engine (SIGTERM, then SIGKILL after a grace period).
KV-event ports (`--kv-events-port P`, `--kv-events-replay-port R`) follow the same layout: each
engine gets P (R) plus its offset from the base port; 0 stays 0 (each engine picks one).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from narwhal.sim.config import KvRole, Role

_START_TIMEOUT_S = 20.0
_STOP_GRACE_S = 5.0
_READY_PREFIX = "narwhal-sim listening on "
_DECODE_OFFSET = 100
# Options the fleet gives each engine itself; forwarding them too would make engines collide.
FLEET_SETS = frozenset({"--port", "--role", "--kv-role", "--engine-id"})
# Options whose port each engine takes at its own offset from the base port.
_OFFSET_PORTS = frozenset({"--kv-events-port", "--kv-events-replay-port"})


@dataclass(frozen=True, slots=True)
class EngineSpec:
    name: str
    port: int
    role: Role
    kv_role: KvRole


def check_layout(prefill: int, decode: int, base_port: int) -> str | None:
    """Why this fleet cannot be laid out (a problem naming the option), or None."""
    if prefill < 0 or decode < 0:
        return "--prefill and --decode must be >= 0"
    if prefill + decode == 0:
        return "--prefill and --decode: the fleet needs at least one engine"
    if prefill > _DECODE_OFFSET:
        return (
            f"--prefill: at most {_DECODE_OFFSET} prefill engines, or their ports would reach "
            f"the decode engines' (from --base-port + {_DECODE_OFFSET})"
        )
    last = base_port + _DECODE_OFFSET + decode - 1 if decode else base_port + prefill - 1
    if base_port < 1 or last > 65535:
        return f"--base-port {base_port}: the fleet's ports would run from {base_port} to {last}"
    return None


def fleet_specs(prefill: int, decode: int, base_port: int) -> list[EngineSpec]:
    """Prefill engines from `base_port`, decode engines from `base_port + 100`."""
    problem = check_layout(prefill, decode, base_port)
    if problem:
        raise ValueError(problem)
    prefills = [
        EngineSpec(f"prefill-{i}", base_port + i, Role.PREFILL, KvRole.PRODUCER)
        for i in range(prefill)
    ]
    decodes = [
        EngineSpec(f"decode-{i}", base_port + _DECODE_OFFSET + i, Role.DECODE, KvRole.CONSUMER)
        for i in range(decode)
    ]
    return prefills + decodes


def engine_args(offset: int, extra: Sequence[str]) -> list[str]:
    """The forwarded options for the engine at `offset` from the base port: its KV-event ports
    moved by the same offset (0, any free port, stays 0)."""
    out: list[str] = []
    pending: str | None = None
    for arg in extra:
        name, eq, value = arg.partition("=")
        if pending is not None:
            out.append(_moved(arg, offset))
            pending = None
        elif name in _OFFSET_PORTS and eq:
            out.append(f"{name}={_moved(value, offset)}")
        else:
            pending = arg if arg in _OFFSET_PORTS else None
            out.append(arg)
    return out


def _moved(port: str, offset: int) -> str:
    return port if not port.isdigit() or int(port) == 0 else str(int(port) + offset)


async def _spawn(spec: EngineSpec, host: str, extra: Sequence[str]) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "narwhal.sim.cli",
        "serve",
        "--host",
        host,
        "--port",
        str(spec.port),
        "--role",
        spec.role.value,
        "--kv-role",
        spec.kv_role.value,
        "--engine-id",
        spec.name,
        *extra,
        stdout=asyncio.subprocess.PIPE,
    )


async def _ready_url(spec: EngineSpec, proc: asyncio.subprocess.Process) -> str:
    assert proc.stdout is not None
    try:
        async with asyncio.timeout(_START_TIMEOUT_S):
            line = (await proc.stdout.readline()).decode()
    except TimeoutError:
        raise RuntimeError(
            f"{spec.name} (port {spec.port}) not listening after {_START_TIMEOUT_S:.0f} s"
        ) from None
    if not line.startswith(_READY_PREFIX):
        status = await proc.wait()
        raise RuntimeError(f"{spec.name} (port {spec.port}) exited with status {status}")
    return line[len(_READY_PREFIX) :].strip()


async def _stop(procs: Sequence[asyncio.subprocess.Process]) -> None:
    for proc in procs:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
    for proc in procs:
        try:
            async with asyncio.timeout(_STOP_GRACE_S):
                await proc.wait()
        except TimeoutError:
            proc.kill()
            await proc.wait()


async def _report_exit(name: str, proc: asyncio.subprocess.Process) -> None:
    status = await proc.wait()
    print(f"narwhal-sim fleet: {name} exited with status {status}", file=sys.stderr, flush=True)


async def run_fleet(
    prefill: int, decode: int, base_port: int, host: str, extra: Sequence[str]
) -> int:
    """Start the fleet, print each engine's URL, and run until signalled; returns an exit code."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    specs = fleet_specs(prefill, decode, base_port)
    procs: list[asyncio.subprocess.Process] = []
    try:
        for spec in specs:
            procs.append(await _spawn(spec, host, engine_args(spec.port - base_port, extra)))
        urls = await asyncio.gather(*(_ready_url(s, p) for s, p in zip(specs, procs, strict=True)))
    except (RuntimeError, OSError) as exc:
        print(f"narwhal-sim fleet: an engine did not start: {exc}", file=sys.stderr, flush=True)
        await _stop(procs)
        return 1
    for spec, url in zip(specs, urls, strict=True):
        print(f"narwhal-sim fleet: {spec.role.value} {spec.name} {url}", flush=True)
    print("narwhal-sim fleet ready", flush=True)
    async with asyncio.TaskGroup() as tg:
        watchers = [
            tg.create_task(_report_exit(s.name, p)) for s, p in zip(specs, procs, strict=True)
        ]
        try:
            await stop.wait()
        finally:
            ignore_stop_signals(loop)
            for w in watchers:
                w.cancel()
            await _stop(procs)
    return 0


def ignore_stop_signals(loop: asyncio.AbstractEventLoop) -> None:
    """Stopping: a further SIGINT or SIGTERM (a second Ctrl-C, the group's) is ignored. While
    asyncio's handler stays installed, one arriving as the loop closes is written to the
    loop's closed wakeup pipe ('Exception ignored ... Bad file descriptor' on stderr)."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.remove_signal_handler(sig)
        signal.signal(sig, signal.SIG_IGN)
