"""`narwhal-serve`: run the router (or validate a config, or run the demo)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import socket
import sys
from collections.abc import Callable, Coroutine
from contextlib import AsyncExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any

import uvloop

from narwhal.cli.args import Parser, add_log_level, add_version
from narwhal.cli.startup import startup_problems, state_paths
from narwhal.config import Config, ConfigError, load_config, parse_config
from narwhal.telemetry.logs import configure as configure_logging

if TYPE_CHECKING:
    from narwhal.server import Router

EXIT_CONFIG = 2  # a bad config file or bad arguments
EXIT_START = 1  # a valid config that could not start (the port in use, the host unresolvable)


class StartupError(Exception):
    """The router could not start; the message names what failed, in one line."""


def _parser() -> argparse.ArgumentParser:
    p = Parser(prog="narwhal-serve", description=__doc__)
    add_version(p)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--config", metavar="FILE", help="the YAML configuration file")
    mode.add_argument(
        "--check-config",
        metavar="FILE",
        help="run every start-up check that needs no network on FILE (with --listen and "
        "--standby as given), then exit: 0 when it would start, 2 naming each problem",
    )
    mode.add_argument("--demo", action="store_true", help="start a local simulated fleet too")
    p.add_argument("--listen", help="host:port, overrides `listen` from the config")
    p.add_argument("--resume", action="store_true", help="apply the saved handoff if it matches")
    p.add_argument("--standby", action="store_true", help="run as a warm standby")
    add_log_level(p, "INFO")
    p.add_argument("--log-format", choices=("text", "json"), default="text")
    return p


def _fail_config(problems: list[str]) -> int:
    for problem in problems:
        print(f"narwhal-serve: config error: {problem}", file=sys.stderr)
    return EXIT_CONFIG


def check_startable(config: Config, *, standby: bool = False) -> list[str]:
    """Every start-up check that needs no network (`narwhal.cli.startup`): what `--config`
    refuses, `--check-config` refuses too, with the same line."""
    return startup_problems(config, standby=standby)


def _demo_problems(listen: str) -> list[str]:
    """The demo's config with placeholder engines, checked before any sim starts: the same
    checks as a --config run (the demo has no admin token)."""
    from narwhal.cli.demo import demo_config

    try:
        placeholder = demo_config(["http://127.0.0.1:1"], ["http://127.0.0.1:2"], listen)
    except ConfigError as exc:
        return exc.problems
    return check_startable(placeholder)


def _make_state_dirs(config: Config) -> None:
    """Create the directories of the handoff document and of a `file` lease, so a fresh host
    starts. The start-up checks found them creatable; one that still cannot be created (the
    host changed since) is a StartupError naming its key."""
    for key, path in state_paths(config).items():
        directory = Path(path).parent
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StartupError(
                f"{key}: cannot create directory {str(directory)!r}: {exc.strerror or exc}"
            ) from None


async def _run_router(
    router: Router, config: Config, on_ready: Callable[[int], None] | None = None
) -> None:
    """Run the router; an OSError before it serves (the port in use, an unresolvable listen
    host, an unreadable state file) is a StartupError naming what failed."""
    ready = False

    def ready_now(port: int) -> None:
        nonlocal ready
        ready = True
        if on_ready is not None:
            on_ready(port)

    try:
        await router.run(config.listen_host, config.listen_port, on_ready=ready_now)
    except OSError as exc:
        if ready:
            raise
        if isinstance(exc, socket.gaierror):
            raise StartupError(f"listen {config.listen}: {exc.strerror or exc}") from None
        raise StartupError(str(exc)) from None


async def _serve(config: Config, path: Path, resume: bool, standby: bool) -> None:
    from narwhal.server import Router

    await asyncio.to_thread(_make_state_dirs, config)
    router = Router(config, resume=resume, standby=standby, config_path=path)
    await _run_router(router, config)


async def _demo(listen: str) -> None:
    from narwhal.cli.demo import banner, demo_config, start_fleet
    from narwhal.server import Router

    async with AsyncExitStack() as stack:
        try:
            roles = ["prefill", "prefill", "decode", "decode", "decode"]
            *engines, spare = await start_fleet(stack, roles)
            prefill, decode = engines[:2], engines[2:]
        except (RuntimeError, TimeoutError, OSError) as exc:
            raise StartupError(f"demo fleet: {exc or type(exc).__name__}") from None
        config = demo_config(prefill, decode, listen)
        await asyncio.to_thread(_make_state_dirs, config)
        router = Router(config)
        url = f"http://{config.listen_host}:{config.listen_port}"
        await _run_router(router, config, on_ready=lambda _: print(banner(url, spare), flush=True))


async def _main_async(coro: Coroutine[Any, Any, None]) -> None:
    """Run until done or until SIGINT/SIGTERM cancel it (shutdown is cancellation)."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, task.cancel)
    with contextlib.suppress(asyncio.CancelledError):
        await coro


def _run(coro: Coroutine[Any, Any, None]) -> int:
    """Run the program on uvloop, as the workers run; a start-up failure is one line on
    stderr and exit status 1. With `workers: 1` this process is the data plane, where the
    event loop is a large share of a request's CPU (docs/performance-log.md, "uvloop in the
    one-process router, and new connections starved on uvloop")."""
    try:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(_main_async(coro))
    except StartupError as exc:
        print(f"narwhal-serve: start-up failed: {exc}", file=sys.stderr)
        return EXIT_START
    return 0


def _load(path: str, listen: str | None) -> Config:
    """The config file, with `--listen` applied (ConfigError naming the key)."""
    config = load_config(path)
    if listen:
        config = parse_config({**config.model_dump(mode="json"), "listen": listen})
    return config


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    configure_logging(args.log_level, args.log_format)
    if args.demo:
        listen = args.listen or "127.0.0.1:8080"
        problems = _demo_problems(listen)
        if problems:
            return _fail_config(problems)
        return _run(_demo(listen))
    path = args.check_config or args.config
    if not path:
        print("narwhal-serve: give --config FILE, --check-config FILE or --demo", file=sys.stderr)
        return EXIT_CONFIG
    try:
        config = _load(path, args.listen)
    except ConfigError as exc:
        return _fail_config(exc.problems)
    # One set of checks for both: a config --check-config calls OK is one --config starts.
    problems = check_startable(config, standby=args.standby)
    if problems:
        return _fail_config(problems)
    if args.check_config:
        print(f"config OK: {path} ({len(config.engines)} engines)")
        return 0
    if args.standby and config.standby.active_url is None:
        logging.getLogger("narwhal.serve").warning(
            "standby.active_url is not set: this standby takes over only when the lease "
            "expires, never after standby.takeover_threshold failing /ready checks"
        )
    return _run(_serve(config, Path(path), resume=args.resume, standby=args.standby))


if __name__ == "__main__":
    sys.exit(main())
