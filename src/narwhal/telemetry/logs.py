"""Logging set-up: structured JSON (one event per line) for machines, text for humans.

Log calls attach structured fields with `extra=` (transitions: `engine`, `from`, `to`,
`reason`; stage errors: `stage`, `exception`; lease events: `epoch`, `holder`, ...). The JSON
format renders every such field next to `ts`, `level`, `logger` and `message`; the text format
shows only the message, which already says the same in words.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import orjson

# Attributes every LogRecord has; anything else on a record came from `extra=`.
_STANDARD = frozenset(vars(logging.makeLogRecord({}))) | {"message", "asctime", "taskName"}
_CORE = ("ts", "level", "logger", "message")


def extra_fields(record: logging.LogRecord) -> dict[str, Any]:
    """The structured fields a log call attached with `extra=`."""
    return {
        k: v
        for k, v in vars(record).items()
        if k not in _STANDARD and not k.startswith("_") and k not in _CORE
    }


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        event: dict[str, Any] = {
            "ts": record.created,
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        event.update(extra_fields(record))
        if record.exc_info:
            event["traceback"] = self.formatException(record.exc_info)
        return orjson.dumps(event, default=str).decode()


def configure(level: str, fmt: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    # The access log (`logging.access`): bare JSON lines, whatever the level and format.
    access = logging.StreamHandler(sys.stderr)
    access.setFormatter(logging.Formatter("%(message)s"))
    access_log = logging.getLogger("narwhal.access")
    access_log.handlers[:] = [access]
    access_log.propagate = False
    access_log.setLevel(logging.INFO)
