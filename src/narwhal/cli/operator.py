"""`narwhal`: the operator CLI over the router's admin API."""

from __future__ import annotations

import argparse
import http.client
import json
import os
import sys
import time
import urllib.error
import urllib.request
from typing import Any

from narwhal.cli import membership, progress
from narwhal.cli.args import POSITIVE, POSITIVE_INT, Parser, add_version, http_url

EXIT_ERROR = 1
EXIT_USAGE = 2


class AdminError(Exception):
    """A failure to talk to the router, printed as `narwhal: <reason>` (exit 1)."""


def _call(url: str, token: str | None, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    try:
        request = urllib.request.Request(url.rstrip("/") + path, data=data, method=method)
    except ValueError as exc:
        raise AdminError(f"bad --url {url!r}: {exc}") from None
    if data is not None:
        request.add_header("Content-Type", "application/json")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        body = exc.read()
        try:
            return exc.code, json.loads(body)
        except ValueError:
            return exc.code, {"error": {"message": body.decode(errors="replace")}}
    except (urllib.error.URLError, OSError, http.client.HTTPException, ValueError) as exc:
        raise AdminError(f"cannot reach {url}: {getattr(exc, 'reason', exc)}") from None
    try:
        return status, json.loads(raw or b"null")
    except ValueError:
        raise AdminError(
            f"{url}{path} answered {status} with something other than JSON "
            "(is --url a narwhal router?)"
        ) from None


def _message(body: Any) -> str:
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return str(body["error"].get("message"))
    return json.dumps(body)


STEP_LABELS = {"passed": "ok", "failed": "FAIL", "not_configured": "skip", "unknown": "skip"}


def _step_label(step: dict[str, Any]) -> str:
    """`ok`, `FAIL`, or `skip` for a step that could not judge (attestation not configured,
    a generation the engine does not export): an unchecked step is not reported as passed."""
    status = step.get("status") or ("passed" if step["ok"] else "failed")
    return STEP_LABELS.get(status, str(status))


def _table(engines: list[dict[str, Any]]) -> str:
    rows = [
        (
            "ENGINE",
            "ROLE",
            "ELIGIBLE",
            "EJECTED",
            "HOLDS",
            "EVIDENCE",
            "LIVENESS",
            "IN-FLIGHT",
            "MODEL",
        )
    ]
    for e in engines:
        evidence = ",".join(f"{k}={v}" for k, v in e["evidence"].items() if v) or "-"
        holds = ",".join(e["holds"]) or "-"
        ejected = e["ejection"]["cause"] if e["ejection"] else "-"
        rows.append(
            (
                e["id"],
                e["role"],
                "yes" if e["eligible"] else "no",
                ejected,
                holds,
                evidence,
                str(e["liveness_misses"]),
                str(e["in_flight"]),
                e.get("model") or "-",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
    )


def placement_line(p: dict[str, Any]) -> str:
    """`placement: prefix; m hit rate 93.1% (9,310 of 10,000 prompt tokens); cached blocks
    p0 120, p1 80`: the policy, each model's hit rate, each engine's blocks."""
    parts = [f"placement: {p['policy']}"]
    for model, x in p.get("models", {}).items():
        rate = "-" if x["hit_rate"] is None else f"{x['hit_rate']:.1%}"
        parts.append(
            f"{model} hit rate {rate} ({x['hit_tokens']:,.0f} of {x['lookup_tokens']:,.0f} "
            "prompt tokens)"
        )
    rates = ", ".join(
        f"{e} {'-' if x['hit_rate'] is None else format(x['hit_rate'], '.1%')}"
        for e, x in p.get("engines", {}).items()
    )
    if rates:
        parts.append(f"hit rate by prefill engine {rates}")
    blocks = ", ".join(f"{e} {n}" for e, n in p.get("cached_blocks", {}).items())
    if blocks:
        parts.append(f"cached blocks {blocks}")
    return "; ".join(parts)


def flow_lines(f: dict[str, Any]) -> list[str]:
    """`/admin/flow` for `narwhal status`: whether the queue runs, what waits by priority
    (with its oldest wait), streams asked to step aside by priority (preemption), and every
    refusal by reason, rate limits by key."""
    if f["enabled"]:
        head = f"flow: on, {f['waiting']} waiting of {f['queue_limit']}"
        if f.get("oldest_wait_s") is not None:
            head += f" (oldest {f['oldest_wait_s']:.1f} s)"
        head += f", {f['running']} running"
        if f.get("resuming"):
            head += f", {f['resuming']} stepped aside"
    else:
        head = "flow: off" + (", rate limits on" if f.get("rate_limits") else "")
    lines = [head]
    for p in f.get("priorities", []):
        lines.append(
            f"  priority {p['priority']}: {p['waiting']} waiting, oldest {p['oldest_wait_s']:.1f} s"
        )
    preempted = f.get("preempted") or {}
    if preempted:
        lines.append("  preempted: " + ", ".join(f"priority {p} {n}" for p, n in preempted.items()))
    refused = f.get("refused") or {}
    if refused:
        lines.append("  refused: " + ", ".join(f"{r} {n}" for r, n in refused.items()))
    for key, reasons in (f.get("refused_by_key") or {}).items():
        counts = ", ".join(f"{r} {n}" for r, n in reasons.items())
        lines.append(f"  refused key {key}: {counts}")
    return lines


URL_HELP = "the router's base URL (default: $NARWHAL_URL, else http://127.0.0.1:8080)"
TOKEN_HELP = "the admin bearer token (default: $NARWHAL_ADMIN_TOKEN)"


def _connection_flags() -> Parser:
    """`--url`/`--token` again on every subcommand, so they may follow it too
    (`narwhal drain p1 --url ...`). SUPPRESS: absent there, the top-level value (flag, else
    environment) stands; given in both places, the later one wins."""
    flags = Parser(add_help=False)
    flags.add_argument("--url", type=http_url, default=argparse.SUPPRESS, help=URL_HELP)
    flags.add_argument("--token", default=argparse.SUPPRESS, help=TOKEN_HELP)
    return flags


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="narwhal", description=__doc__)
    add_version(p)
    p.add_argument(
        "--url",
        type=http_url,
        default=os.environ.get("NARWHAL_URL", "http://127.0.0.1:8080"),
        help=URL_HELP,
    )
    p.add_argument("--token", default=os.environ.get("NARWHAL_ADMIN_TOKEN"), help=TOKEN_HELP)
    common = [_connection_flags()]
    sub = p.add_subparsers(dest="command", required=True)
    status = sub.add_parser(
        "status", parents=common, help="engines, flow control, lease and monitor at a glance"
    )
    status.add_argument("--watch", action="store_true", help="refresh until Ctrl-C")
    status.add_argument("--interval-s", type=POSITIVE, default=2.0, help="with --watch")
    status.add_argument("--count", type=POSITIVE_INT, help="with --watch: stop after this many")
    events = sub.add_parser("events", parents=common, help="the event timeline")
    events.add_argument("--follow", action="store_true", help="print new events as they come")
    engines = sub.add_parser("engines", parents=common, help="the engines as the router sees them")
    engines.add_argument("--json", action="store_true")
    membership.add_parsers(engines, [*common])
    for name in ("drain", "maintenance", "readmit"):
        action = sub.add_parser(name, parents=common, help=f"{name} an engine")
        action.add_argument("engine_id")
        if name == "drain":
            action.add_argument(
                "--wait", action="store_true", help="follow it until nothing is in flight"
            )
            action.add_argument("--timeout-s", type=POSITIVE, default=600.0, help="with --wait")
        if name == "maintenance":
            action.add_argument(
                "--migrate",
                action="store_true",
                help="move the engine's in-flight streams to other engines now instead of "
                "letting them finish there (serving.policy bounded)",
            )
    handoff = sub.add_parser("handoff", parents=common, help="inspect or validate a handoff file")
    hsub = handoff.add_subparsers(dest="handoff_command", required=True)
    inspect = hsub.add_parser(
        "inspect",
        aliases=["show"],
        parents=common,
        help="print a handoff readably: FILE, or the router's latest over the admin API",
    )
    inspect.add_argument("file", nargs="?")
    validate = hsub.add_parser(
        "validate", parents=common, help="check a handoff against the schema and config"
    )
    validate.add_argument("file")
    validate.add_argument(
        "--config",
        help="the router's YAML configuration; without it the engine set is not checked",
    )
    sub.add_parser("lease", parents=common, help="the lease as the router sees it")
    sub.add_parser("reload", parents=common, help="re-read the router's config file and apply it")
    args = p.parse_args(argv)
    if args.command == "handoff" and args.handoff_command == "show":
        args.handoff_command = "inspect"
    if args.command == "handoff" and (args.handoff_command != "inspect" or args.file):
        return _handoff(args)
    try:
        return _run(args)
    except AdminError as exc:
        print(f"narwhal: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except (KeyError, TypeError, AttributeError) as exc:  # JSON, but not the admin API's shape
        print(
            f"narwhal: unexpected answer from {args.url} ({type(exc).__name__}: {exc})",
            file=sys.stderr,
        )
        return EXIT_ERROR


def _handoff(args: argparse.Namespace) -> int:
    """Offline: no router needed."""
    from pathlib import Path

    from narwhal.config import ConfigError, load_config
    from narwhal.state.handoff import (
        UnreadableHandoff,
        Verdict,
        check_document,
        load_schema,
        read_handoff,
        shape_complaint,
    )

    try:
        raw = read_handoff(Path(args.file))
    except UnreadableHandoff as exc:
        if args.handoff_command == "inspect":
            print(f"narwhal: {args.file}: {exc.reason}", file=sys.stderr)
            return EXIT_ERROR
        print(f"invalid: {exc}")
        return EXIT_ERROR
    if args.handoff_command == "inspect":
        if raw is None:
            print(f"narwhal: {args.file}: no such file", file=sys.stderr)
            return EXIT_ERROR
        try:
            doc = json.loads(raw)
        except ValueError as exc:
            print(f"narwhal: {args.file}: not valid JSON: {exc}", file=sys.stderr)
            return EXIT_ERROR
        complaint = shape_complaint(doc, load_schema())
        if complaint is not None:
            print(f"narwhal: {args.file}: {complaint}", file=sys.stderr)
            return EXIT_ERROR
        print(_describe_handoff(doc))
        return 0
    config = None
    if args.config is not None:
        try:
            config = load_config(args.config)
        except ConfigError as exc:
            for problem in exc.problems:
                print(f"narwhal: config error: {problem}", file=sys.stderr)
            return EXIT_USAGE
    verdict: Verdict = check_document(raw, config, load_schema(), now_wall_s=time.time())
    print(("valid: " if verdict.ok else "invalid: ") + verdict.reason)
    if config is None:
        print(UNCHECKED_WITHOUT_CONFIG)
    return 0 if verdict.ok else EXIT_ERROR


UNCHECKED_WITHOUT_CONFIG = (
    "note: no --config: the engine set and kv_role permits were not checked against a configuration"
)


def _describe_handoff(doc: dict[str, Any]) -> str:
    writer = doc.get("writer", {})
    lines = [
        f"schema {doc.get('schema')}  sequence {doc.get('sequence')}  "
        f"written_at {doc.get('written_at')}",
        f"writer {writer.get('router_id')} pid {writer.get('pid')} "
        f"lease epoch {writer.get('lease_epoch')}",
        f"lease {doc.get('lease')}",
        "",
    ]
    for engine_id, e in sorted((doc.get("engines") or {}).items()):
        holds = ",".join(h["name"] for h in e.get("holds", [])) or "-"
        if e.get("inference_verification"):
            holds = (holds + ",inference_verification").lstrip("-,")
        ejected = e["ejection"]["cause"] if e.get("ejection") else "-"
        lines.append(
            f"{engine_id:12} {e.get('role', '?'):8} ejected={ejected:16} holds={holds}"
            f" generation={e.get('generation')} verified={e.get('verified', True)}"
        )
    lines.append(f"\nconsolidation risk {json.dumps(doc.get('consolidation_risk'))}")
    lines.append(f"counters {json.dumps(doc.get('counters'))}")
    return "\n".join(lines)


def _describe_reload(body: dict[str, Any]) -> str:
    lines = ["reloaded"]
    lines.append("applied: " + (", ".join(body["applied"]) or "nothing changed"))
    if body["restart_required"]:
        lines.append("needs a restart (left as it was): " + ", ".join(body["restart_required"]))
    engines = body.get("engines")
    if engines:
        changes = [f"{what} {', '.join(ids)}" for what, ids in engines.items() if ids]
        lines.append("engines: " + ("; ".join(changes) or "unchanged"))
    return "\n".join(lines)


def _run(args: argparse.Namespace) -> int:
    if args.command == "handoff":  # inspect without a file: the router's latest document
        status, body = _call(args.url, args.token, "GET", "/admin/handoff")
        if status != 200:
            print(f"narwhal: {status}: {_message(body)}", file=sys.stderr)
            return EXIT_ERROR
        print(f"path {body['path']}  sequence {body['sequence']}")
        resume = body.get("resume")
        if resume is not None:
            print(f"resume: {'applied' if resume['applied'] else 'refused'} ({resume['reason']})")
        document = body.get("document")
        print(_describe_handoff(document) if document else "no handoff written yet")
        return 0
    if args.command == "lease":
        status, body = _call(args.url, args.token, "GET", "/admin/lease")
        if status != 200:
            print(f"narwhal: {status}: {_message(body)}", file=sys.stderr)
            return EXIT_ERROR
        print(json.dumps(body, indent=2))
        return 0
    if args.command == "reload":
        status, body = _call(args.url, args.token, "POST", "/admin/reload")
        if status != 200:
            print(f"narwhal: {status}: {_message(body)}", file=sys.stderr)
            return EXIT_ERROR
        print(_describe_reload(body))
        return 0
    if args.command == "engines" and args.engines_command is not None:
        return membership.run(
            args, lambda *request: _call(args.url, args.token, *request), _message
        )
    if args.command == "status" and args.watch:
        args.watch = False
        return progress.watch(lambda: _run(args), args.interval_s, args.count)
    if args.command == "events":
        return progress.events(args, lambda *request: _call(args.url, args.token, *request))
    if args.command == "readmit":
        return progress.readmit(args, _step_label)
    if args.command in ("status", "engines"):
        status, body = _call(args.url, args.token, "GET", "/admin/engines")
        if status != 200:
            print(f"narwhal: {status}: {_message(body)}", file=sys.stderr)
            return EXIT_ERROR
        if args.command == "engines" and args.json:
            print(json.dumps(body, indent=2))
            return 0
        print(_table(body["engines"]))
        if args.command == "status":
            risk = body.get("consolidation_risk") or {}
            print(
                "\nconsolidation risk: "
                + ", ".join(
                    f"{role} {r['eligible']} eligible{' (HIGH)' if r['high'] else ''}"
                    f" busiest {r.get('busiest_share', 0.0):.0%}"
                    for role, r in risk.items()
                )
                if risk
                else "\nconsolidation risk: -"
            )
            if body.get("placement"):
                print(placement_line(body["placement"]))
            try:
                flow_status, flow = _call(args.url, args.token, "GET", "/admin/flow")
            except AdminError as exc:  # an older router: the rest of the status still shows
                print(f"flow: unavailable ({exc})")
            else:
                if flow_status != 200:
                    print(f"flow: unavailable ({flow_status}: {_message(flow)})")
                else:
                    print("\n".join(flow_lines(flow)))
            lease_status, lease = _call(args.url, args.token, "GET", "/admin/lease")
            if lease_status != 200:
                print(f"lease: unavailable ({lease_status}: {_message(lease)})")
            elif isinstance(lease, dict):
                line = f"lease: {lease.get('backend')}, this router {lease.get('role')}"
                if lease.get("holder") is not None:
                    line += f", holder {lease['holder']} epoch {lease.get('epoch')}"
                if lease.get("time_left_s") is not None:
                    line += f", {lease['time_left_s']:.1f} s left"
                if lease.get("fence_reason"):
                    line += f" ({lease['fence_reason']})"
                print(line)
            monitor_status, monitor = _call(args.url, args.token, "GET", "/admin/monitor")
            if monitor_status != 200:
                print(f"narwhal: {monitor_status}: {_message(monitor)}", file=sys.stderr)
                return EXIT_ERROR
            print(
                f"\nmonitor: streak {monitor['streak']}/{monitor['failure_limit']}, "
                f"admitting: {'yes' if monitor['admitting'] else 'no'}"
                + (f", {monitor['degraded']}" if monitor["degraded"] else "")
            )
        return 0
    migrate = getattr(args, "migrate", False)
    status, body = _call(
        args.url,
        args.token,
        "POST",
        f"/admin/engines/{args.engine_id}/{args.command}",
        {"migrate": True} if migrate else None,
    )
    if status != 200:
        print(f"narwhal: {status}: {_message(body)}", file=sys.stderr)
        return EXIT_ERROR
    moving = ", its streams moving to other engines" if body.get("migrate") else ""
    print(f"{args.engine_id}: {body.get('hold', 'ok')}{moving}")
    if getattr(args, "wait", False):
        return progress.drain_wait(args, lambda *request: _call(args.url, args.token, *request))
    return 0


if __name__ == "__main__":
    sys.exit(main())
