"""Atomic handoff writes (spec "Atomic handoff writes", DESIGN §4), one process.

The recipe: a process-unique temporary file in the destination's directory, the complete
document, fsync, rename over the destination, fsync the directory; file mode 0600. Faults
are injected through the `Filesystem` seam: whatever fails, the temporary file is removed,
the previous document stays intact, and the error reaches the caller. Crashes and
concurrent writers across real processes are in tests/e2e/test_handoff_processes.py.
"""

from __future__ import annotations

import errno
import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from narwhal.state.atomic import (
    Filesystem,
    atomic_write,
    host_tag,
    remove_stale_temps,
    temp_name,
)

OLD = b'{"document": "old"}'
NEW = b'{"document": "new", "padding": "' + b"x" * 100_000 + b'"}'


class Recording(Filesystem):
    """The real file system, with every call logged and one call optionally failing."""

    def __init__(self, fail: str | None = None, exc: BaseException | None = None) -> None:
        self.fail = fail
        self.exc = exc
        self.calls: list[tuple[str, object]] = []
        self.temps: list[Path] = []
        self.max_write = 1 << 30

    def _maybe_fail(self, name: str) -> None:
        if name == self.fail:
            assert self.exc is not None
            raise self.exc

    def open_exclusive(self, path: Path, mode: int) -> int:
        self.calls.append(("open_exclusive", path))
        self.temps.append(path)
        self._maybe_fail("open_exclusive")
        return super().open_exclusive(path, mode)

    def write(self, fd: int, data: memoryview) -> int:
        self.calls.append(("write", len(data)))
        self._maybe_fail("write")
        return super().write(fd, data[: self.max_write])

    def fsync(self, fd: int) -> None:
        self.calls.append(("fsync", fd))
        self._maybe_fail("fsync")
        super().fsync(fd)

    def close(self, fd: int) -> None:
        self.calls.append(("close", fd))
        super().close(fd)
        self._maybe_fail("close")  # closed, then the error (as NFS reports late EIO)

    def replace(self, src: Path, dest: Path) -> None:
        self.calls.append(("replace", (src, dest)))
        self._maybe_fail("replace")
        super().replace(src, dest)

    def unlink(self, path: Path) -> None:
        self.calls.append(("unlink", path))
        super().unlink(path)

    def fsync_dir(self, path: Path) -> None:
        self.calls.append(("fsync_dir", path))
        self._maybe_fail("fsync_dir")
        super().fsync_dir(path)

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]


class ShortThenENOSPC(Recording):
    """The disk fills up part-way: the first write is short, the second fails."""

    def write(self, fd: int, data: memoryview) -> int:
        self.calls.append(("write", len(data)))
        if sum(1 for n in self.names() if n == "write") > 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return Filesystem.write(self, fd, data[:4096])


@pytest.fixture
def dest(tmp_path: Path) -> Path:
    directory = tmp_path / "state"
    directory.mkdir()
    return directory / "handoff.json"


def listing(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


@pytest.fixture
def permissive_umask() -> Iterator[None]:
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


# --------------------------------------------------------------------------- the recipe
def test_a_write_creates_the_complete_document_and_nothing_else(dest: Path) -> None:
    atomic_write(dest, NEW)
    assert dest.read_bytes() == NEW
    assert listing(dest.parent) == ["handoff.json"]


def test_a_write_replaces_the_previous_document(dest: Path) -> None:
    atomic_write(dest, OLD)
    atomic_write(dest, NEW)
    assert dest.read_bytes() == NEW
    assert listing(dest.parent) == ["handoff.json"]


@pytest.mark.usefixtures("permissive_umask")
def test_the_file_mode_is_0600_even_with_a_permissive_umask(dest: Path) -> None:
    atomic_write(dest, NEW)
    assert stat.S_IMODE(dest.stat().st_mode) == 0o600


@pytest.mark.usefixtures("permissive_umask")
def test_a_world_readable_previous_file_is_replaced_by_a_0600_one(dest: Path) -> None:
    dest.write_bytes(OLD)
    dest.chmod(0o644)
    atomic_write(dest, NEW)
    assert stat.S_IMODE(dest.stat().st_mode) == 0o600


def test_the_steps_run_in_the_recipes_order(dest: Path) -> None:
    fs = Recording()
    atomic_write(dest, NEW, fs=fs)
    assert fs.names() == ["open_exclusive", "write", "fsync", "close", "replace", "fsync_dir"]
    (tmp,) = fs.temps
    assert ("replace", (tmp, dest)) in fs.calls
    assert ("fsync_dir", dest.parent) in fs.calls


def test_short_writes_are_continued_until_the_document_is_complete(dest: Path) -> None:
    fs = Recording()
    fs.max_write = 7_000
    atomic_write(dest, NEW, fs=fs)
    assert dest.read_bytes() == NEW
    assert fs.names().count("write") == -(-len(NEW) // 7_000)
    assert fs.names().index("fsync") > max(i for i, n in enumerate(fs.names()) if n == "write")


def test_the_temporary_file_is_beside_the_destination_and_process_unique(dest: Path) -> None:
    fs = Recording()
    atomic_write(dest, OLD, fs=fs)
    atomic_write(dest, NEW, fs=fs)
    first, second = fs.temps
    for tmp in (first, second):
        assert tmp.parent == dest.parent  # same directory: the rename never crosses devices
        assert tmp.name.startswith(f".handoff.json.{os.getpid()}.")
        assert tmp.name.endswith(".tmp")
    assert first != second  # unique per write as well as per process


def test_the_temporary_name_carries_the_writing_processs_pid(dest: Path) -> None:
    code = (
        "import os, sys; from pathlib import Path; from narwhal.state.atomic import temp_name;"
        "print(os.getpid(), temp_name(Path(sys.argv[1])).name)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(dest)], capture_output=True, text=True, check=True
    ).stdout.split()
    child_pid, child_name = int(out[0]), out[1]
    assert child_pid != os.getpid()
    assert child_name.startswith(f".handoff.json.{child_pid}.")
    assert temp_name(dest).name.startswith(f".handoff.json.{os.getpid()}.")


def test_an_existing_temporary_name_is_never_reused(dest: Path) -> None:
    """O_EXCL: a stale file of the same name makes the write fail, never writes through it."""

    class Colliding(Recording):
        def open_exclusive(self, path: Path, mode: int) -> int:
            path.write_bytes(b"someone else's")
            return super().open_exclusive(path, mode)

    atomic_write(dest, OLD)
    with pytest.raises(FileExistsError):
        atomic_write(dest, NEW, fs=Colliding())
    assert dest.read_bytes() == OLD


# --------------------------------------------------------------------------- write failures
FAULTS = [
    pytest.param("write", OSError(errno.ENOSPC, "No space left on device"), id="ENOSPC-on-write"),
    pytest.param("fsync", OSError(errno.EIO, "Input/output error"), id="EIO-on-fsync"),
    pytest.param("close", OSError(errno.EIO, "Input/output error"), id="EIO-on-close"),
    pytest.param("replace", OSError(errno.EXDEV, "Invalid cross-device link"), id="replace"),
    pytest.param(
        "replace", PermissionError(errno.EACCES, "Permission denied"), id="replace-EACCES"
    ),
    pytest.param("write", KeyboardInterrupt(), id="interrupted-mid-write"),
]


@pytest.mark.parametrize(("step", "exc"), FAULTS)
def test_a_failed_write_leaves_the_previous_document_and_no_temporary_file(
    dest: Path, step: str, exc: BaseException
) -> None:
    atomic_write(dest, OLD)
    fs = Recording(fail=step, exc=exc)
    with pytest.raises(type(exc)) as raised:
        atomic_write(dest, NEW, fs=fs)
    assert raised.value is exc  # the caller sees the real error, not a cleanup error
    assert dest.read_bytes() == OLD
    assert listing(dest.parent) == ["handoff.json"]
    (tmp,) = fs.temps
    assert ("unlink", tmp) in fs.calls
    assert "close" in fs.names()  # the descriptor is not leaked either


def test_a_disk_that_fills_up_part_way_leaves_the_previous_document(dest: Path) -> None:
    atomic_write(dest, OLD)
    fs = ShortThenENOSPC()
    with pytest.raises(OSError) as raised:
        atomic_write(dest, NEW, fs=fs)
    assert raised.value.errno == errno.ENOSPC
    assert fs.names().count("write") == 2
    assert dest.read_bytes() == OLD
    assert listing(dest.parent) == ["handoff.json"]


def test_a_failed_first_write_leaves_no_destination_and_no_temporary_file(dest: Path) -> None:
    with pytest.raises(OSError):
        atomic_write(dest, NEW, fs=Recording("fsync", OSError(errno.EIO, "EIO")))
    assert listing(dest.parent) == []


def test_a_failed_directory_fsync_after_the_rename_is_not_a_failed_write(dest: Path) -> None:
    """The rename already happened: the new document is complete and no temporary file
    remains, so the write is not failed (which would mean "previous destination intact"); the
    caller learns that durability is not confirmed from the result and `on_unsynced`."""
    atomic_write(dest, OLD)
    seen: list[OSError] = []
    error = OSError(errno.EIO, "EIO")
    synced = atomic_write(dest, NEW, fs=Recording("fsync_dir", error), on_unsynced=seen.append)
    assert synced is False
    assert seen == [error]
    assert dest.read_bytes() == NEW
    assert listing(dest.parent) == ["handoff.json"]
    assert atomic_write(dest, OLD, on_unsynced=seen.append) is True
    assert len(seen) == 1


def test_a_failed_open_creates_nothing(dest: Path) -> None:
    atomic_write(dest, OLD)
    with pytest.raises(OSError):
        atomic_write(dest, NEW, fs=Recording("open_exclusive", OSError(errno.EMFILE, "EMFILE")))
    assert dest.read_bytes() == OLD
    assert listing(dest.parent) == ["handoff.json"]


def test_a_removed_directory_makes_the_write_raise_and_leave_nothing(dest: Path) -> None:
    atomic_write(dest, OLD)
    dest.unlink()
    dest.parent.rmdir()
    with pytest.raises(FileNotFoundError):
        atomic_write(dest, NEW)
    assert not dest.parent.exists()
    assert listing(dest.parent.parent) == []


def test_a_directory_replaced_by_a_file_makes_the_write_raise_and_leave_nothing(
    dest: Path,
) -> None:
    atomic_write(dest, OLD)
    dest.unlink()
    dest.parent.rmdir()
    dest.parent.write_bytes(b"not a directory")
    with pytest.raises(NotADirectoryError):
        atomic_write(dest, NEW)
    assert dest.parent.read_bytes() == b"not a directory"
    assert listing(dest.parent.parent) == ["state"]


class DirectorySwappedMidWrite(Recording):
    """While the document is being written the state directory is moved away and a regular
    file takes its name; then the disk reports ENOSPC. Removing the temporary file by its
    path now fails with ENOTDIR."""

    def write(self, fd: int, data: memoryview) -> int:
        self.calls.append(("write", len(data)))
        directory = self.temps[0].parent
        directory.rename(directory.with_name("moved-away"))
        directory.write_bytes(b"not a directory")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_failed_cleanup_does_not_hide_the_error_that_caused_it(dest: Path) -> None:
    atomic_write(dest, OLD)
    fs = DirectorySwappedMidWrite()
    with pytest.raises(OSError) as raised:
        atomic_write(dest, NEW, fs=fs)
    assert raised.value.errno == errno.ENOSPC  # not the NotADirectoryError of the cleanup
    assert fs.names()[-1] == "unlink"  # the cleanup was attempted
    moved = dest.parent.with_name("moved-away")
    assert (moved / dest.name).read_bytes() == OLD


def test_a_destination_that_is_a_directory_makes_the_write_raise_and_leave_nothing(
    dest: Path,
) -> None:
    dest.mkdir()
    with pytest.raises(IsADirectoryError):
        atomic_write(dest, NEW)
    assert dest.is_dir() and listing(dest) == []
    assert listing(dest.parent) == ["handoff.json"]


# --------------------------------------------------------------------------- stale temps
def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_remove_stale_temps_removes_only_dead_writers_temporary_files(dest: Path) -> None:
    atomic_write(dest, OLD)
    gone, host = dead_pid(), host_tag()
    stale = [dest.with_name(f".handoff.json.{gone}.{host}.{t}.tmp") for t in ("00aa11bb", "ff")]
    live = dest.with_name(f".handoff.json.{os.getpid()}.{host}.0123abcd.tmp")
    elsewhere = "0" * 8 if host != "0" * 8 else "1" * 8
    others = [
        dest.with_name(f".other.json.{gone}.{host}.00aa11bb.tmp"),  # another destination's
        dest.with_name(f"handoff.json.{gone}.{host}.00aa11bb.tmp"),  # not hidden: not ours
        dest.with_name(f".handoff.json.{gone}.{host}.XYZ.tmp"),  # not hex
        dest.with_name(f".handoff.json.{gone}.{host}.00aa11bb.tmp.bak"),
        # Another host's writer (a shared directory): its pid means nothing here.
        dest.with_name(f".handoff.json.{gone}.{elsewhere}.00aa11bb.tmp"),
        dest.with_name("notes.txt"),
    ]
    for path in (*stale, live, *others):
        path.write_bytes(b"partial")
    removed = remove_stale_temps(dest)
    assert sorted(removed) == sorted(stale)
    assert sorted(listing(dest.parent)) == sorted(
        ["handoff.json", live.name, *(p.name for p in others)]
    )
    assert dest.read_bytes() == OLD


def test_remove_stale_temps_matches_the_names_atomic_write_uses(dest: Path) -> None:
    """A temporary file as `atomic_write` names it, left by a pid that is gone, is removed."""
    name = temp_name(dest).name.replace(f".{os.getpid()}.", f".{dead_pid()}.", 1)
    (dest.parent / name).write_bytes(b"partial")
    assert [p.name for p in remove_stale_temps(dest)] == [name]
    assert listing(dest.parent) == []


def test_remove_stale_temps_on_a_missing_directory_removes_nothing(tmp_path: Path) -> None:
    assert remove_stale_temps(tmp_path / "missing" / "handoff.json") == []
