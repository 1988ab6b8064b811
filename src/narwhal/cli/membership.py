"""`narwhal engines add` and `narwhal engines remove`: membership changes over the admin API
(DESIGN §10), each followed until it has taken effect: an added engine until it takes work
(verified and eligible), a removed one until the router has forgotten it. Every state seen on
the way is printed once."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any
from urllib.parse import quote

from narwhal.cli.args import POSITIVE
from narwhal.cli.progress import follow
from narwhal.config import KvRole, Role

EXIT_OK, EXIT_ERROR = 0, 1

Call = Callable[..., tuple[int, Any]]


def add_parsers(engines: argparse.ArgumentParser, common: list[argparse.ArgumentParser]) -> None:
    sub = engines.add_subparsers(dest="engines_command")
    add = sub.add_parser("add", parents=common, help="add an engine to the running fleet")
    add.add_argument("engine_id")
    # Not `url`: that is the router's (`--url`), which would be overwritten.
    add.add_argument("engine_url", metavar="url", help="the engine's base URL")
    add.add_argument("--role", required=True, choices=[r.value for r in Role])
    add.add_argument("--kv-role", choices=[r.value for r in KvRole])
    add.add_argument("--model", help="the model it serves (default: the router's `model`)")
    add.add_argument("--api", choices=["vllm", "llamacpp"])
    add.add_argument("--api-key-env", help="the environment variable holding its API key")
    add.add_argument("--slot-save-path", help="llamacpp: the shared --slot-save-path")
    remove = sub.add_parser("remove", parents=common, help="remove an engine from the fleet")
    remove.add_argument("engine_id")
    remove.add_argument(
        "--force",
        action="store_true",
        help="forget it at once; its requests in flight finish or fail on their own",
    )
    for parser in (add, remove):
        parser.add_argument(
            "--timeout-s", type=POSITIVE, default=120.0, help="how long to follow the change"
        )
        parser.add_argument(
            "--no-wait", action="store_true", help="return once the router accepted the change"
        )


def run(args: argparse.Namespace, call: Call, message: Callable[[Any], str]) -> int:
    if args.engines_command == "add":
        body = {"id": args.engine_id, "url": args.engine_url, "role": args.role}
        for key in ("kv_role", "model", "api", "api_key_env", "slot_save_path"):
            if getattr(args, key) is not None:
                body[key] = getattr(args, key)
        status, answer = call("POST", "/admin/engines", body)
        if status != 201:
            print(f"narwhal: {status}: {message(answer)}", file=sys.stderr)
            return EXIT_ERROR
        print(f"{args.engine_id}: added ({answer['state']})")
        return EXIT_OK if args.no_wait else follow(args, call, _until_in_service, gone_ok=False)
    path = f"/admin/engines/{quote(args.engine_id)}" + ("?force=true" if args.force else "")
    status, answer = call("DELETE", path)
    if status not in (200, 202):
        print(f"narwhal: {status}: {message(answer)}", file=sys.stderr)
        return EXIT_ERROR
    if answer["change"] == "removed":
        print(f"{args.engine_id}: removed")
        return EXIT_OK
    print(f"{args.engine_id}: removing, {answer['in_flight']} in flight")
    return EXIT_OK if args.no_wait else follow(args, call, _until_gone, gone_ok=True)


def _until_in_service(engine: dict[str, Any] | None) -> tuple[str, bool]:
    if engine is None:
        return "no longer in the fleet", True
    if engine["eligible"]:
        return "in service", True
    if not engine["verified"]:
        return f"unverified ({engine['unverified_reason']})", False
    if engine["ejected"]:
        return f"ejected ({engine['ejection']['reason']})", False
    return f"held ({', '.join(engine['holds'])})", False


def _until_gone(engine: dict[str, Any] | None) -> tuple[str, bool]:
    if engine is None:
        return "removed", True
    return f"removing, {engine['in_flight']} in flight", False
