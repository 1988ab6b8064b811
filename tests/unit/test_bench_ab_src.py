"""`python -m bench --ab-src`: a Narwhal target's `@base` twin runs the other source tree."""

from __future__ import annotations

from pathlib import Path

import pytest
from bench.suites.common import spec_for


def test_a_base_twin_is_the_same_narwhal_from_the_other_tree() -> None:
    base = Path("/work/other/src")
    twin = spec_for("narwhal-w2@base", base)
    plain = spec_for("narwhal-w2", base)
    assert (twin.name, twin.kind, twin.workers, twin.src) == ("narwhal-w2@base", "narwhal", 2, base)
    assert (plain.name, plain.workers, plain.src) == ("narwhal-w2", 2, None)


@pytest.mark.parametrize(
    ("name", "ab_src"),
    [("narwhal-w1@base", None), ("vllm-router@base", Path("/x")), ("narwhal-w1@head", Path("/x"))],
)
def test_a_twin_needs_a_narwhal_target_and_ab_src(name: str, ab_src: Path | None) -> None:
    with pytest.raises(ValueError, match="@base twin"):
        spec_for(name, ab_src)
