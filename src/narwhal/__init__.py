"""Narwhal: a router and control plane for prefill/decode-disaggregated LLM serving."""

from __future__ import annotations

# The name the project is installed under (`pip install narwhal-router`); the import package
# stays `narwhal`. `version()` and every CLI's `--version` read the installed metadata by it.
DISTRIBUTION = "narwhal-router"


def version() -> str:
    """The installed distribution's version (its metadata, not a constant in the source), or
    `unknown` when Narwhal runs from a source tree that was never installed. Imported here,
    not above: `importlib.metadata` costs every process that imports Narwhal (each worker,
    each simulator) 30-45 ms, and only `--version` needs it."""
    from importlib import metadata

    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return "unknown"
