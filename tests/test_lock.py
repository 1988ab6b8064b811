"""The lock files agree with pyproject.toml: CI and the image install what the ranges allow.

pyproject.toml declares compatible ranges (so Narwhal installs beside other packages);
requirements/ci.lock and requirements/runtime.lock pin every dependency, transitive ones
included (`make lock` writes them). A range changed without re-locking fails here, not in CI's
install step.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]


def _pins(lock: str) -> dict[str, str]:
    pins: dict[str, str] = {}
    for line in (REPO / "requirements" / lock).read_text().splitlines():
        if line and not line[0].isspace() and not line.startswith("#"):
            name, version = line.split("==")
            pins[canonicalize_name(name)] = version.strip()
    return pins


def _declared(*extras: str) -> list[Requirement]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    lines = list(project["dependencies"])
    for extra in extras:
        lines += project["optional-dependencies"][extra]
    env = default_environment() | {"platform_machine": "x86_64", "sys_platform": "linux"}
    reqs = [Requirement(line) for line in lines]
    return [r for r in reqs if r.marker is None or r.marker.evaluate(env)]


def test_every_declared_dependency_is_locked_within_its_range() -> None:
    for lock, extras in (("ci.lock", ("test", "tracing")), ("runtime.lock", ("tracing",))):
        pins = _pins(lock)
        for req in _declared(*extras):
            name = canonicalize_name(req.name)
            assert name in pins, f"{req.name} is not in requirements/{lock}: run `make lock`"
            assert req.specifier.contains(pins[name], prereleases=True), (
                f"requirements/{lock} pins {name}=={pins[name]}, outside {req}: run `make lock`"
            )


def test_the_image_runs_the_versions_ci_tested() -> None:
    ci, runtime = _pins("ci.lock"), _pins("runtime.lock")
    assert runtime.items() <= ci.items()


def test_runtime_dependencies_are_ranges_not_pins() -> None:
    pinned = [str(r) for r in _declared() if any(s.operator == "==" for s in r.specifier)]
    assert pinned == [], "runtime dependencies are ranges; exact versions live in the locks"
