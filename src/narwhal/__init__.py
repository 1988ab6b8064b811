"""Narwhal: a router and control plane for prefill/decode-disaggregated LLM serving."""

from __future__ import annotations

from importlib import metadata

__version__ = "0.1.0"

# The name the project is installed under (`pip install narwhal-router`); the import package
# stays `narwhal`. `version()` and every CLI's `--version` read the installed metadata by it.
DISTRIBUTION = "narwhal-router"
# The distribution's name before the rename, read when only it is installed (an environment
# installed before the rename); drop once every environment was reinstalled.
_FORMER_DISTRIBUTIONS = ("narwhal",)


def version() -> str:
    """The installed distribution's version (its metadata, not a constant in the source), or
    `unknown` when Narwhal runs from a source tree that was never installed."""
    for name in (DISTRIBUTION, *_FORMER_DISTRIBUTIONS):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return "unknown"
