"""Long operations that show their progress (issue 20 §4): `narwhal readmit` prints each
verification step as it happens, `narwhal drain --wait` follows the engine until nothing is
in flight, `narwhal status --watch` refreshes, `narwhal events [--follow]` prints the event
timeline as it grows. All over the admin API."""

from __future__ import annotations

import argparse
import http.client
import json
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import Any

EXIT_OK, EXIT_ERROR = 0, 1
POLL_S = 0.5

Call = Callable[..., tuple[int, Any]]


class StreamError(Exception):
    """The router could not be reached, or answered with an error (status, message)."""


def lines(url: str, token: str | None, method: str, path: str) -> Iterator[Any]:
    """The NDJSON lines of an answer, each as soon as it arrives."""
    request = urllib.request.Request(url.rstrip("/") + path, method=method)
    request.add_header("Accept", "application/x-ndjson")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=300) as resp:
            while line := resp.readline():
                if not line.strip():
                    continue
                try:
                    parsed = json.loads(line)
                except ValueError:
                    raise StreamError(
                        f"{url.rstrip('/')}{path} answered {resp.status} with something other "
                        "than JSON (is --url a narwhal router?)"
                    ) from None
                yield parsed
    except urllib.error.HTTPError as exc:
        try:
            message = json.loads(exc.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = exc.reason
        raise StreamError(f"{exc.code}: {message}") from None
    except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
        raise StreamError(f"cannot reach {url}: {getattr(exc, 'reason', exc)}") from None


def readmit(args: argparse.Namespace, label: Callable[[dict[str, Any]], str]) -> int:
    """Each step as it happens, then the verdict (exit 0 when readmitted)."""
    path = f"/admin/engines/{args.engine_id}/readmit"
    try:
        for line in lines(args.url, args.token, "POST", path):
            if "step" in line:
                print(f"{label(line):4} {line['step']}: {line['reason']}", flush=True)
            elif "readmitted" in line:
                print("readmitted" if line["readmitted"] else "not readmitted")
                return EXIT_OK if line["readmitted"] else EXIT_ERROR
    except StreamError as exc:
        print(f"narwhal: {exc}", file=sys.stderr)
        return EXIT_ERROR
    print("narwhal: the router ended the readmission without a verdict", file=sys.stderr)
    return EXIT_ERROR


Progress = Callable[[dict[str, Any] | None], tuple[str, bool]]
"""The engine's record (None: not in the fleet) -> (what to print, whether it is done)."""


def follow(args: argparse.Namespace, call: Call, progress: Progress, gone_ok: bool) -> int:
    """Poll `/admin/engines`, printing each new state of `args.engine_id` once, until
    `progress` says done (exit 0; 1 when the engine is gone and that is not what was
    awaited) or `--timeout-s` passes (exit 1)."""
    deadline = time.monotonic() + args.timeout_s
    last = None
    while True:
        status, body = call("GET", "/admin/engines")
        if status != 200:
            print(f"narwhal: {status} while following {args.engine_id}", file=sys.stderr)
            return EXIT_ERROR
        engine = next((e for e in body["engines"] if e["id"] == args.engine_id), None)
        line, done = progress(engine)
        if line != last:
            print(f"{args.engine_id}: {line}", flush=True)
            last = line
        if done:
            return EXIT_OK if engine is not None or gone_ok else EXIT_ERROR
        if time.monotonic() >= deadline:
            print(
                f"narwhal: {args.engine_id}: not done after {args.timeout_s:g} s", file=sys.stderr
            )
            return EXIT_ERROR
        time.sleep(POLL_S)


def _until_drained(engine: dict[str, Any] | None) -> tuple[str, bool]:
    if engine is None:
        return "no longer in the fleet", True
    if engine["in_flight"] == 0:
        return "drained, nothing in flight", True
    return f"draining, {engine['in_flight']} in flight", False


def drain_wait(args: argparse.Namespace, call: Call) -> int:
    """After a drain: the engine's in-flight count as it changes, until it reaches zero."""
    return follow(args, call, _until_drained, gone_ok=True)


def watch(show: Callable[[], int], interval_s: float, count: int | None) -> int:
    """`show` every `interval_s` (`count` times, or until Ctrl-C), each under a time line."""
    shown = 0
    try:
        while count is None or shown < count:
            if shown:
                time.sleep(interval_s)
            print(f"--- {datetime.now(UTC).strftime('%H:%M:%S')} UTC", flush=True)
            code = show()
            sys.stdout.flush()
            if code != EXIT_OK:
                return code
            shown += 1
    except KeyboardInterrupt:
        pass
    return EXIT_OK


def events(args: argparse.Namespace, call: Call) -> int:
    """The timeline, oldest first; with `--follow`, new events as they come."""
    after = 0
    while True:
        status, body = call("GET", f"/admin/events?after={after}")
        if status != 200:
            print(f"narwhal: {status} while reading events", file=sys.stderr)
            return EXIT_ERROR
        for event in body["events"]:
            at = datetime.fromtimestamp(event["at"], UTC).strftime("%Y-%m-%d %H:%M:%S")
            engine = event["engine"] or "-"
            print(f"{at}  {event['kind']:10} {engine:12} {event['what']}", flush=True)
        after = body["last"]
        if not args.follow:
            return EXIT_OK
        try:
            time.sleep(POLL_S)
        except KeyboardInterrupt:
            return EXIT_OK
