"""What every Narwhal command line shares: a bad flag is one line on stderr and exit status 2
(never a traceback, never a usage block), `--version`, `--log-level`, and argument types that
refuse out-of-range numbers at parse time."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from narwhal import version

EXIT_USAGE = 2
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line: `<prog>: error: <what> (see --help)`.

    Subparsers are of this class too (argparse makes them of the parent's class)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see --help)\n")


class _Version(argparse.Action):
    """`--version`: the command's name and the installed distribution's version, then exit 0
    (read only when asked: a metadata lookup)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> NoReturn:
        sys.stdout.write(f"{parser.prog.split()[0]} {version()}\n")
        parser.exit(0)


def add_version(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--version", action=_Version, help="print the installed version and exit")


def _log_level(text: str) -> str:
    level = {"WARN": "WARNING"}.get(text.upper(), text.upper())  # Python's alias, kept
    if level not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a log level ({', '.join(LOG_LEVELS)}; any case)"
        )
    return level


def add_log_level(parser: argparse.ArgumentParser, default: str) -> None:
    parser.add_argument(
        "--log-level",
        type=_log_level,
        default=default,
        metavar="LEVEL",
        help=f"{', '.join(LOG_LEVELS)} (any case; default: {default})",
    )


def ranged(
    kind: Callable[[str], float], name: str, ok: Callable[[float], bool]
) -> Callable[[str], float]:
    """An argument type: parse with `kind`, refuse values outside the range `name` describes
    (and NaN or infinity, which no duration or count may be)."""

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {name}") from None
        if not (math.isfinite(value) and ok(value)):
            raise argparse.ArgumentTypeError(f"{text!r} is not {name}")
        return value

    return parse


PORT = ranged(int, "a port (0-65535)", lambda v: 0 <= v <= 65535)
LISTEN_PORT = ranged(int, "a port (1-65535)", lambda v: 1 <= v <= 65535)
POSITIVE_INT = ranged(int, "an integer > 0", lambda v: v > 0)
COUNT = ranged(int, "an integer >= 0", lambda v: v >= 0)
POSITIVE = ranged(float, "a number > 0", lambda v: v > 0)
NON_NEGATIVE = ranged(float, "a number >= 0", lambda v: v >= 0)


def http_url(text: str) -> str:
    """An argument type: an `http://` or `https://` URL with a host (a path prefix is kept,
    for a router behind a proxy's prefix)."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(text)
        parts.port  # noqa: B018 - raises ValueError for a bad port
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an http:// or https:// URL") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise argparse.ArgumentTypeError(f"{text!r} is not an http:// or https:// URL")
    return text
