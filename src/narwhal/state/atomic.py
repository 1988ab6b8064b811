"""Atomic file replacement: a process-unique temporary file, fsync, rename, fsync the dir.

Concurrent writers each leave a complete document, so the destination is always one whole
document. On failure the temporary file is removed and the destination is left intact. A
directory fsync that fails after the rename is not a failed write (the destination already
holds the new document): it is logged, reported to `on_unsynced`, and the write returns False.
File-system calls go through `Filesystem`, the seam tests use to inject write errors.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import secrets
import socket
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("narwhal.atomic")


class Filesystem:
    """The OS calls an atomic write makes; subclass to inject faults (e.g. ENOSPC)."""

    def open_exclusive(self, path: Path, mode: int) -> int:
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)

    def write(self, fd: int, data: memoryview) -> int:
        return os.write(fd, data)

    def fsync(self, fd: int) -> None:
        os.fsync(fd)

    def close(self, fd: int) -> None:
        os.close(fd)

    def replace(self, src: Path, dest: Path) -> None:
        os.replace(src, dest)

    def unlink(self, path: Path) -> None:
        os.unlink(path)

    def fsync_dir(self, path: Path) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def host_tag() -> str:
    """Eight hex digits naming this host: a pid is only meaningful on the host that made it."""
    return hashlib.blake2b(socket.gethostname().encode(), digest_size=4).hexdigest()


def temp_name(dest: Path) -> Path:
    """`.<name>.<pid>.<host>.<random>.tmp` beside the destination: unique per process and
    write, and judged only by routers on the same host (the directory may be shared)."""
    return dest.with_name(f".{dest.name}.{os.getpid()}.{host_tag()}.{secrets.token_hex(4)}.tmp")


def atomic_write(
    dest: Path,
    data: bytes,
    mode: int = 0o600,
    fs: Filesystem | None = None,
    on_unsynced: Callable[[OSError], None] | None = None,
) -> bool:
    """Replace `dest` with `data`; raises (destination intact) if the write fails. Returns
    whether the directory fsync confirmed the rename: False means `dest` holds the new
    document, but a crash might still bring back the previous one."""
    fs = fs or Filesystem()
    tmp = temp_name(dest)
    fd = fs.open_exclusive(tmp, mode)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[fs.write(fd, view) :]
            fs.fsync(fd)
        finally:
            fs.close(fd)
        fs.replace(tmp, dest)
    except BaseException:
        # Any cleanup failure (the file already gone, the directory replaced by a file or
        # removed meanwhile: ENOTDIR, EACCES...) must not hide the error that got us here.
        with contextlib.suppress(OSError):
            fs.unlink(tmp)
        raise
    try:
        fs.fsync_dir(dest.parent)
    except OSError as exc:
        log.warning("%s written, but its directory fsync failed: %s", dest, exc)
        if on_unsynced is not None:
            on_unsynced(exc)
        return False
    return True


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temps(dest: Path) -> list[Path]:
    """Remove temporary files left by writers on this host that died mid-write (their pid is
    gone). Another host's files are left alone: its pids mean nothing here, and one of them
    may be a write in progress (on a shared directory).

    Called at start: a killed writer cannot clean up, so its leftovers are bounded by the
    number of writer crashes between two starts.
    """
    here = host_tag()
    pattern = re.compile(rf"^\.{re.escape(dest.name)}\.(\d+)\.([0-9a-f]{{8}})\.[0-9a-f]+\.tmp$")
    removed: list[Path] = []
    try:
        entries = list(dest.parent.iterdir())
    except OSError:
        return removed
    for entry in entries:
        match = pattern.match(entry.name)
        if match and match[2] == here and not _pid_alive(int(match[1])):
            try:
                entry.unlink()
                removed.append(entry)
            except OSError:
                pass
    return removed
