"""`narwhal-sim`: serve one simulated engine, start a local fleet, or measure an engine.

narwhal-sim [serve] --port 9001 --role prefill --kv-role kv_producer
narwhal-sim fleet --prefill 2 --decode 2 --base-port 9001
narwhal-sim bench --url http://127.0.0.1:9001 [--workload shared-prefix]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import signal
import socket
import sys
import uuid
from collections.abc import Callable, Sequence

from pydantic import ValidationError

from narwhal.cli.args import (
    COUNT,
    LISTEN_PORT,
    NON_NEGATIVE,
    PORT,
    POSITIVE,
    POSITIVE_INT,
    Parser,
    add_log_level,
    add_version,
    http_url,
    ranged,
)
from narwhal.clock import SystemClock
from narwhal.sim.bench import SharedPrefix, run_bench
from narwhal.sim.config import KvRole, LoadFailurePolicy, Role, SimConfig
from narwhal.sim.faults import FaultSpec
from narwhal.sim.fleet import FLEET_SETS, check_layout, ignore_stop_signals, run_fleet
from narwhal.sim.kv_events import BlockHashFormat, EventEncoding
from narwhal.sim.server import SimServer

_COMMANDS = ("serve", "fleet", "bench")
EXIT_START = 1  # valid arguments, but the engine could not start (port in use, host unknown)


def _engine_options(p: argparse.ArgumentParser) -> None:
    d = SimConfig()
    p.add_argument("--host", default=d.host)
    p.add_argument("--port", type=PORT, default=8000, help="0 picks a free port")
    p.add_argument("--role", choices=[r.value for r in Role], default=d.role.value)
    p.add_argument("--kv-role", choices=[r.value for r in KvRole], default=d.kv_role.value)
    p.add_argument("--model", default=d.model)
    p.add_argument(
        "--lora",
        action="append",
        default=[],
        metavar="NAME",
        help="a LoRA adapter served under NAME (repeatable), as vLLM lists it in /v1/models",
    )
    p.add_argument("--max-model-len", type=POSITIVE_INT, default=d.max_model_len)
    p.add_argument("--engine-id", default=None, help="default: a random UUID")
    p.add_argument("--ttft-per-token-ms", type=NON_NEGATIVE, default=d.ttft_per_token_ms)
    p.add_argument("--itl-ms", type=NON_NEGATIVE, default=d.itl_ms)
    p.add_argument("--transfer-per-block-ms", type=NON_NEGATIVE, default=d.transfer_per_block_ms)
    p.add_argument("--max-concurrency", type=POSITIVE_INT, default=d.max_concurrency)
    p.add_argument("--kv-ttl-s", type=NON_NEGATIVE, default=d.kv_ttl_s)
    p.add_argument(
        "--kv-load-failure-policy",
        choices=[x.value for x in LoadFailurePolicy],
        default=d.kv_load_failure_policy.value,
    )
    p.add_argument("--kv-load-timeout-s", type=POSITIVE, default=d.kv_load_timeout_s)
    p.add_argument(
        "--no-token-ids",
        action="store_true",
        help="ignore return_token_ids, as an engine without token ids in its answers",
    )
    p.add_argument("--seed", type=int, default=None, help="seed ids and fault probabilities")
    p.add_argument(
        "--fault",
        action="append",
        default=[],
        metavar="JSON",
        help='a fault as the /sim/faults API takes it, e.g. \'{"kind":"no_done"}\'; repeatable',
    )
    add_log_level(p, "WARNING")
    _cache_options(p, d)


FRACTION = ranged(float, "a number from 0 to 1", lambda v: 0 <= v <= 1)


def _cache_options(p: argparse.ArgumentParser, d: SimConfig) -> None:
    """The prefix cache, the waiting queue and the KV-event publisher (docs/simulator.md)."""
    p.add_argument("--block-size", type=POSITIVE_INT, default=d.block_size, help="tokens")
    p.add_argument(
        "--kv-blocks", type=COUNT, default=d.kv_blocks, help="prefix cache blocks (0: no cache)"
    )
    p.add_argument("--max-num-seqs", type=POSITIVE_INT, default=None, help="default: no limit")
    p.add_argument(
        "--serial-prefill",
        action="store_true",
        help="running requests' prompts are computed one at a time, as a GPU shares its compute",
    )
    p.add_argument("--kv-events-port", type=PORT, default=None, help="0 picks a free port")
    p.add_argument("--kv-events-replay-port", type=PORT, default=None, help="0: a free port")
    p.add_argument("--kv-events-topic", default=d.kv_events_topic)
    p.add_argument(
        "--kv-events-encoding",
        choices=[e.value for e in EventEncoding],
        default=d.kv_events_encoding.value,
    )
    p.add_argument(
        "--kv-events-block-hash",
        choices=[f.value for f in BlockHashFormat],
        default=d.kv_events_block_hash.value,
    )
    p.add_argument("--kv-events-drop-fraction", type=FRACTION, default=0.0)
    p.add_argument("--tokenizer", default=None, metavar="PATH", help="a tokenizer.json or its dir")


def _parser() -> argparse.ArgumentParser:
    parser = Parser(prog="narwhal-sim", description=__doc__.split("\n")[0])
    add_version(parser)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run one simulated vLLM engine")
    add_version(serve)  # `narwhal-sim --version` is `narwhal-sim serve --version`
    _engine_options(serve)
    fleet = sub.add_parser(
        "fleet",
        help="run N prefill and M decode engines; other options go to every engine",
        usage="%(prog)s [--prefill N] [--decode M] [--base-port P] [--host H] [engine options]",
    )
    fleet.add_argument("--prefill", type=COUNT, default=1)
    fleet.add_argument("--decode", type=COUNT, default=1)
    fleet.add_argument("--base-port", type=LISTEN_PORT, default=9001, help="decode engines at +100")
    fleet.add_argument("--host", default="127.0.0.1")
    bench = sub.add_parser("bench", help="measure an engine's non-streaming throughput")
    bench.add_argument("--url", type=http_url, required=True)
    bench.add_argument("--concurrency", type=POSITIVE_INT, default=32)
    bench.add_argument("--duration-s", type=POSITIVE, default=5.0)
    bench.add_argument("--max-tokens", type=POSITIVE_INT, default=16)
    bench.add_argument("--stream", action="store_true")
    bench.add_argument("--model", default="demo-model", help="the body's `model`")
    bench.add_argument(
        "--workload",
        choices=["repeat", "shared-prefix"],
        default="repeat",
        help="repeat: one prompt every time; shared-prefix: GROUPS long system prompts, each "
        "request one of them and a short question",
    )
    bench.add_argument("--groups", type=POSITIVE_INT, default=16, help="shared-prefix groups")
    bench.add_argument(
        "--prefix-words", type=POSITIVE_INT, default=400, help="words per shared-prefix preamble"
    )
    bench.add_argument("--seed", type=int, default=None, help="seed the workload's prompts")
    for command in (serve, fleet, bench):
        command.set_defaults(command_parser=command)  # its own usage line for errors
    return parser


def _config(args: argparse.Namespace) -> SimConfig:
    return SimConfig(
        host=args.host,
        port=args.port,
        role=Role(args.role),
        kv_role=KvRole(args.kv_role),
        model=args.model,
        max_model_len=args.max_model_len,
        engine_id=args.engine_id or str(uuid.uuid4()),
        ttft_per_token_ms=args.ttft_per_token_ms,
        itl_ms=args.itl_ms,
        transfer_per_block_ms=args.transfer_per_block_ms,
        max_concurrency=args.max_concurrency,
        kv_ttl_s=args.kv_ttl_s,
        kv_load_failure_policy=LoadFailurePolicy(args.kv_load_failure_policy),
        kv_load_timeout_s=args.kv_load_timeout_s,
        token_ids=not args.no_token_ids,
        lora=tuple(args.lora),
        block_size=args.block_size,
        kv_blocks=args.kv_blocks,
        max_num_seqs=args.max_num_seqs,
        serial_prefill=args.serial_prefill,
        kv_events_port=args.kv_events_port,
        kv_events_replay_port=args.kv_events_replay_port,
        kv_events_topic=args.kv_events_topic,
        kv_events_encoding=EventEncoding(args.kv_events_encoding),
        kv_events_block_hash=BlockHashFormat(args.kv_events_block_hash),
        kv_events_drop_fraction=args.kv_events_drop_fraction,
        tokenizer=args.tokenizer,
    )


async def _until_signalled(server: SimServer, started: Callable[[str], None]) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await server.run(started, stop)
    finally:
        ignore_stop_signals(loop)


def startup_oserror(exc: BaseException) -> OSError | None:
    """The OSError behind a start-up failure (bare, or the only kind in an exception group)."""
    if isinstance(exc, OSError):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        match, rest = exc.split(OSError)
        if match is not None and rest is None:
            return startup_oserror(match.exceptions[0])
    return None


def startup_problem(exc: OSError, host: str) -> str:
    """One line naming what failed: the host that does not resolve, or the OS's own message
    (a bind failure names the address and port)."""
    if isinstance(exc, socket.gaierror):
        return f"--host {host}: {exc.strerror or exc}"
    return str(exc)


def serve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    try:
        faults = [FaultSpec.model_validate_json(f) for f in args.fault]
    except ValidationError as exc:
        args.command_parser.error(f"--fault: {exc}")
    config = _config(args)
    if problem := config.problem():
        args.command_parser.error(problem)
    logging.basicConfig(level=args.log_level, stream=sys.stderr)
    server = SimServer(
        config,
        clock=SystemClock(),
        rng=random.Random(args.seed),
        faults=faults,
    )
    listening = False

    def started(url: str) -> None:
        nonlocal listening
        listening = True
        print(f"narwhal-sim listening on {url}", flush=True)

    try:
        asyncio.run(_until_signalled(server, started))
    except BaseException as exc:
        cause = None if listening else startup_oserror(exc)
        if cause is None:
            raise
        print(f"narwhal-sim: start-up failed: {startup_problem(cause, args.host)}", file=sys.stderr)
        sys.exit(EXIT_START)


def _check_fleet(args: argparse.Namespace, extra: list[str]) -> None:
    """Refuse a fleet that cannot start before any engine does: a bad layout, options the fleet
    sets per engine, or engine options out of range (checked by the engine's own parser)."""
    fleet: argparse.ArgumentParser = args.command_parser
    problem = check_layout(args.prefill, args.decode, args.base_port)
    if problem:
        fleet.error(problem)
    for arg in extra:
        if arg.split("=", 1)[0] in FLEET_SETS:
            fleet.error(f"{arg.split('=', 1)[0]}: the fleet sets it for each engine")
    engine = Parser(prog=fleet.prog, usage=fleet.usage, add_help=False)
    _engine_options(engine)
    engine.parse_args(extra)


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in (*_COMMANDS, "-h", "--help"):
        argv.insert(0, "serve")
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    if args.command != "fleet" and extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command == "serve":
        serve(args, parser)
    elif args.command == "fleet":
        _check_fleet(args, extra)
        sys.exit(
            asyncio.run(run_fleet(args.prefill, args.decode, args.base_port, args.host, extra))
        )
    else:
        rng = random.Random(args.seed)
        workload = None
        if args.workload == "shared-prefix":
            workload = SharedPrefix.generate(rng, args.groups, args.prefix_words)
        result = asyncio.run(
            run_bench(
                args.url,
                concurrency=args.concurrency,
                duration_s=args.duration_s,
                max_tokens=args.max_tokens,
                stream=args.stream,
                clock=SystemClock(),
                model=args.model,
                workload=workload,
                rng=rng,
            )
        )
        print(result.summary(), flush=True)


if __name__ == "__main__":
    main()
