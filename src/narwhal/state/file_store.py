"""The `file` lease store: one host or a shared filesystem.

Every operation takes an exclusive `flock` on `<lease.path>.lock`, reads the record, and
writes the new one atomically; a swap compares the whole record the caller read. The
handoff is written under the same lock after checking the epoch, so a fenced router's write
is refused. Guarantees and limits: docs/lease.md.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

import orjson

from narwhal.state.atomic import Filesystem, atomic_write
from narwhal.state.lease import LeaseRecord, StoreUnavailable

T = TypeVar("T")


class FileLeaseStore:
    def __init__(self, path: Path, handoff_path: Path, fs: Filesystem | None = None) -> None:
        self.path = path
        self.handoff_path = handoff_path
        self._lock_path = path.with_name(path.name + ".lock")
        self._fs = fs or Filesystem()
        self.on_handoff_unsynced: Callable[[OSError], None] | None = None

    @contextmanager
    def _locked(self) -> Iterator[None]:
        fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _read(self) -> LeaseRecord | None:
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return None
        try:
            return LeaseRecord.from_json(orjson.loads(raw))
        except (orjson.JSONDecodeError, ValueError, AttributeError) as exc:
            raise StoreUnavailable(f"unreadable lease file {self.path}: {exc}") from None

    def _write(self, record: LeaseRecord) -> None:
        atomic_write(self.path, orjson.dumps(record.to_json()), 0o600, self._fs)

    async def _run(self, fn: Callable[[], T]) -> T:
        def locked() -> T:
            with self._locked():
                return fn()

        try:
            return await asyncio.to_thread(locked)
        except OSError as exc:
            raise StoreUnavailable(f"lease file {self.path}: {exc}") from None

    async def read(self) -> LeaseRecord | None:
        return await self._run(self._read)

    async def swap(self, expected: LeaseRecord | None, record: LeaseRecord) -> bool:
        def op() -> bool:
            if self._read() != expected:
                return False
            self._write(record)
            return True

        return await self._run(op)

    async def renew(self, holder: str, epoch: int, expires_at: float) -> bool:
        def op() -> bool:
            current = self._read()
            if current is None or current.holder != holder or current.epoch != epoch:
                return False
            self._write(LeaseRecord(holder, epoch, expires_at))
            return True

        return await self._run(op)

    async def write_handoff(self, holder: str, epoch: int, data: bytes) -> bool:
        def op() -> bool:
            current = self._read()
            if current is None or current.holder != holder or current.epoch != epoch:
                return False
            atomic_write(self.handoff_path, data, 0o600, self._fs, self.on_handoff_unsynced)
            return True

        def locked() -> bool:
            with self._locked():
                return op()

        # Handoff write errors are the handoff stage's (e.g. its directory vanished), not
        # the lease store's: let them propagate with their own class.
        return await asyncio.to_thread(locked)

    async def read_handoff(self) -> bytes | None:
        def op() -> bytes | None:
            try:
                return self.handoff_path.read_bytes()
            except FileNotFoundError:
                return None

        return await asyncio.to_thread(op)

    async def close(self) -> None:
        return None
