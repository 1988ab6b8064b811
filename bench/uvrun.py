"""Run a module under uvloop from the project's interpreter: `python -m bench.uvrun MODULE ARGS`.

The routers under test (Narwhal, `bench.floor`, `bench.floor_raw`) run on the project's .venv,
which has Narwhal's pins and no uvloop. This launcher makes exactly two packages of the bench
venv importable, `uvloop` and `httptools` (both self-contained compiled extensions, same
CPython), sets uvloop's event loop policy, and runs MODULE as `__main__`. Nothing else of
bench/.venv becomes importable: its other packages (the peers' dependencies) could otherwise
change what aiohttp picks up, and the A/B would no longer differ only in the event loop.
Bench-only: Narwhal's own code is unchanged.
"""

from __future__ import annotations

import asyncio
import importlib.abc
import importlib.machinery
import runpy
import sys
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from pathlib import Path
from types import ModuleType

from bench.venv import VENV

BORROWED = ("uvloop", "httptools")


class _Borrow(importlib.abc.MetaPathFinder):
    """Finds the named top-level packages in one directory, and nothing else."""

    def __init__(self, site: Path, names: Sequence[str]) -> None:
        self.site = str(site)
        self.names = frozenset(names)

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname not in self.names:
            return None
        return importlib.machinery.PathFinder.find_spec(fullname, [self.site])


def borrow(venv: Path = VENV) -> None:
    """Make `uvloop` and `httptools` importable from `venv` when this interpreter lacks them."""
    sites = sorted(venv.glob("lib/python3*/site-packages"))
    if sites:
        sys.meta_path.append(_Borrow(sites[0], BORROWED))  # last: the interpreter's own win


def main(argv: list[str]) -> None:
    if not argv:
        raise SystemExit("usage: python -m bench.uvrun MODULE [ARGS...]")
    borrow()
    import uvloop  # type: ignore[import-not-found,unused-ignore]

    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    sys.argv = argv
    runpy.run_module(argv[0], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
