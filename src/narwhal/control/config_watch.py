"""Reload the config file when it changes (`controller.config_watch_interval_s`), as SIGHUP
does (DESIGN §10). Made for a Kubernetes ConfigMap mount: kubelet writes the new files into a
fresh directory and swaps the `..data` symlink, so the file keeps its path and gets a new
identity, and no signal reaches the router.

`changed` is the pure part: whether the file's stamp differs from the one last acted on. The
loop stats the file in a thread every interval. A file that cannot be stat'ed now (removed,
mid-swap) is no change: the next stamp is compared with the last one acted on. A refused
reload (the file does not validate, its engine set conflicts) is logged and not retried until
the file changes again.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from narwhal.clock import Clock
from narwhal.config import ConfigError
from narwhal.control.membership import MembershipConflict

log = logging.getLogger("narwhal.reload")


@dataclass(frozen=True)
class Stamp:
    """What tells a changed file, its symlinks followed: device, inode, size, mtime."""

    device: int
    inode: int
    size: int
    mtime_ns: int


def stamp(path: Path) -> Stamp | None:
    """The file's stamp now; None when it cannot be stat'ed (blocking: run it in a thread)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return Stamp(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def changed(acted_on: Stamp | None, seen: Stamp | None) -> bool:
    """Whether a file seen as `seen` is to be reloaded, `acted_on` being the stamp the
    router last loaded or reloaded (None: it could not be stat'ed then)."""
    return seen is not None and seen != acted_on


async def watch(
    path: Path, interval_s: float, clock: Clock, reload: Callable[[], Awaitable[object]]
) -> None:
    """Every `interval_s`, reload when the file changed; runs until cancelled."""
    acted_on = await asyncio.to_thread(stamp, path)
    log.info("watching %s for changes every %ss", path, interval_s)
    while True:
        await clock.sleep(interval_s)
        seen = await asyncio.to_thread(stamp, path)
        if not changed(acted_on, seen):
            continue
        acted_on = seen
        log.info("config file %s changed: reloading", path)
        try:
            await reload()
        except (ConfigError, MembershipConflict) as exc:
            log.error("reload (config file changed) refused, nothing changed: %s", exc)
