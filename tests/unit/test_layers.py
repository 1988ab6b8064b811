"""The package layout is the architecture (DESIGN §8.1): nothing imports upward.

`fleet` (engine state and its one owner) is a leaf under everything but the protocol's
failure taxonomy; the data plane and durable state read it and never import the control
plane, which is the only layer that wires the others together below `server`. The root
modules are layers too: `clock`, `config` and `h1_body` import nothing of Narwhal's, `tls`
only the config, the HTTP modules only what their surface serves, and `server` wires
everything.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "narwhal"

ALLOWED: dict[str, set[str]] = {
    "fleet": {"clock", "config", "engine"},
    "engine": {"clock", "config", "h1_body"},
    "dataplane": {"clock", "config", "engine", "fleet", "flow", "placement", "telemetry"},
    "state": {"clock", "config", "fleet", "telemetry"},
    "telemetry": {"clock", "config", "engine", "fleet"},
    "discovery": {"clock", "config"},
    "placement": {"clock", "config"},
    # Flow control's pure decisions (DESIGN §13): the engines' scraped load is placement's.
    "flow": {"clock", "config", "placement"},
    "control": {
        "clock",
        "config",
        "dataplane",
        "discovery",
        "engine",
        "fleet",
        "flow",
        "placement",
        "state",
        "telemetry",
    },
    # The worker processes and the control process's side of them: wiring, like `server`.
    "process": {
        "clock",
        "config",
        "control",
        "dataplane",
        "engine",
        "fleet",
        "flow",
        "h1_body",
        "placement",
        "state",
        "telemetry",
        "tls",
    },
    # The root modules.
    "clock": set(),
    "config": set(),
    "h1_body": set(),  # a message body's buffer, for the engine client and the client server
    "tls": {"config"},
    # the admin app's aiohttp answers (`openai_error`): the data plane never imports aiohttp
    "http_errors": {"dataplane"},
    "http_membership": {
        "config",
        "control",
        "dataplane",
        "http_errors",
        "server",
    },  # `server`: types only
    # `server`: types only; `telemetry`: the admin documents (admin_views)
    "http_routes": {"dataplane", "http_errors", "http_membership", "server", "state", "telemetry"},
    "server": {
        "clock",
        "config",
        "control",
        "dataplane",
        "engine",
        "fleet",
        "flow",
        "http_errors",
        "http_routes",
        "placement",
        "process",
        "state",
        "telemetry",
        "tls",
    },
}


def imported_packages(package: str) -> set[str]:
    found: set[str] = set()
    module = SRC / f"{package}.py"
    paths = [module] if module.is_file() else list((SRC / package).rglob("*.py"))
    assert paths, f"no module or package {package}"
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                parts = node.module.split(".")
                if parts[0] == "narwhal" and len(parts) > 1:
                    found.add(parts[1])
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    parts = alias.name.split(".")
                    if parts[0] == "narwhal" and len(parts) > 1:
                        found.add(parts[1])
    return found - {package}


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_a_package_imports_only_the_layers_below_it(package: str) -> None:
    assert imported_packages(package) <= ALLOWED[package]


def test_every_package_and_root_module_has_its_layer() -> None:
    """A new package or root module is placed in `ALLOWED` (the CLIs and the simulator sit
    on top and may import anything)."""
    names = {p.stem for p in SRC.glob("*.py") if p.stem != "__init__"}
    names |= {p.name for p in SRC.iterdir() if (p / "__init__.py").is_file()}
    assert names - {"cli", "sim"} <= ALLOWED.keys()


def test_the_engine_state_leaf_takes_only_the_failure_taxonomy_from_engine() -> None:
    modules = {
        node.module
        for path in (SRC / "fleet").rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom)
        and node.module
        and node.module.startswith("narwhal.engine")
    }
    assert modules == {"narwhal.engine.failures"}


def test_a_data_plane_worker_starts_without_importing_aiohttp() -> None:
    """A worker serves the data plane on its own HTTP/1 stacks; aiohttp (about 0.1 s of a
    worker's start) is imported only at its first forward to the control process."""
    probe = "import sys, narwhal.process.worker; print('aiohttp' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"
