"""Filesystem faults under a live writer."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def remove_live_dir(path: Path) -> None:
    """Make a directory disappear while a router writes into it: rename it away in one step
    (the router's next write finds it gone), then delete the renamed tree. A plain `rmtree`
    races the writer: a temporary file created between its listing and its `rmdir` fails it
    with "Directory not empty" (seen once in a clean-clone CI run)."""
    gone = path.with_name(path.name + ".removed")
    os.rename(path, gone)
    shutil.rmtree(gone, ignore_errors=True)  # a straggling write may still land in it
