"""When a watched config file is reloaded (`control/config_watch.py`): on a changed stamp,
never on an unchanged or unreadable file; and a kubelet-style `..data` symlink swap changes
the stamp of the path that stays the same."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from narwhal.control.config_watch import Stamp, changed, stamp

A = Stamp(device=1, inode=10, size=100, mtime_ns=1_000)


@pytest.mark.parametrize(
    ("acted_on", "seen", "reload"),
    [
        (A, A, False),  # nothing changed
        (A, None, False),  # cannot be stat'ed now (removed, mid-swap): wait for it
        (None, None, False),
        (None, A, True),  # back after it could not be stat'ed
        (A, Stamp(1, 11, 100, 1_000), True),  # a new file under the same path (a swap)
        (A, Stamp(1, 10, 101, 1_000), True),  # edited in place
        (A, Stamp(1, 10, 100, 2_000), True),  # rewritten to the same size
        (A, Stamp(2, 10, 100, 1_000), True),  # another filesystem
    ],
)
def test_changed(acted_on: Stamp | None, seen: Stamp | None, reload: bool) -> None:
    assert changed(acted_on, seen) is reload


def _configmap_dir(root: Path, version: str, text: str) -> None:
    """What kubelet does on an update: files in a fresh directory, `..data` swapped to it
    atomically (a rename over the old link), the old directory removed."""
    fresh = root / f"..{version}"
    fresh.mkdir()
    (fresh / "narwhal.yaml").write_text(text)
    old = (root / "..data").resolve() if (root / "..data").exists() else None
    (root / "..data_tmp").symlink_to(fresh.name)
    os.replace(root / "..data_tmp", root / "..data")
    if not (root / "narwhal.yaml").is_symlink():
        (root / "narwhal.yaml").symlink_to("..data/narwhal.yaml")
    if old is not None:
        (old / "narwhal.yaml").unlink()
        old.rmdir()


def test_a_symlink_swap_changes_the_stamp_of_the_same_path(tmp_path: Path) -> None:
    _configmap_dir(tmp_path, "v1", "model: a\n")
    path = tmp_path / "narwhal.yaml"
    first = stamp(path)
    assert first is not None and stamp(path) == first
    _configmap_dir(tmp_path, "v2", "model: b\n")  # the same size
    second = stamp(path)
    assert changed(first, second)
    assert path.read_text() == "model: b\n"


def test_a_missing_file_has_no_stamp(tmp_path: Path) -> None:
    assert stamp(tmp_path / "absent.yaml") is None
    (tmp_path / "dangling.yaml").symlink_to("nowhere")
    assert stamp(tmp_path / "dangling.yaml") is None
