"""`narwhal.version()`: the installed distribution's version, read from its metadata by the one
distribution name in `narwhal.DISTRIBUTION` (every CLI's `--version` prints it)."""

from __future__ import annotations

from importlib import metadata

import pytest

import narwhal


def test_the_version_is_the_installed_distributions() -> None:
    assert narwhal.version() == metadata.version("narwhal-router")


def test_the_distribution_is_named_once() -> None:
    assert narwhal.DISTRIBUTION == "narwhal-router"


def test_a_source_tree_that_was_never_installed_says_unknown(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(narwhal, "DISTRIBUTION", "narwhal-router-not-installed")
    assert narwhal.version() == "unknown"
