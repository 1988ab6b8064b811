"""deploy/systemd/narwhal.service: `systemd-analyze verify` (and `security --offline`) where
systemd-analyze exists, in a scratch root holding the unit, systemd's own units and a stand-in
for the executable; and always a reading of the unit's directives (the hardening, the token's
environment file, the state directory, exit status 2 not restarted)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from narwhal.config import ServingConfig
from tests.deploy.dockerfile import REPO

UNIT = REPO / "deploy" / "systemd" / "narwhal.service"
ANALYZE = shutil.which("systemd-analyze")
SYSTEM_UNITS = Path("/usr/lib/systemd/system")


def directives(text: str) -> dict[str, dict[str, list[str]]]:
    """{section: {key: [values, in order]}}; systemd allows a key more than once."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        assert current is not None, f"a directive outside any section: {line}"
        key, sep, value = line.partition("=")
        assert sep, f"not a Key=value line: {line}"
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def service() -> dict[str, list[str]]:
    return directives(UNIT.read_text())["Service"]


def single(key: str) -> str:
    values = service().get(key)
    assert values is not None, f"{key}= is not set"
    assert len(values) == 1, f"{key}= is set {len(values)} times"
    return values[0]


def seconds(value: str) -> float:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(s|min)?", value)
    assert match, value
    return float(match[1]) * (60 if match[2] == "min" else 1)


def test_the_unit_is_hardened() -> None:
    assert single("DynamicUser") == "yes" or single("User") not in {"", "root", "0"}
    assert single("ProtectSystem") == "strict"
    assert single("ProtectHome") == "yes"
    assert single("PrivateTmp") == "yes"  # the control socket and metric files go to /tmp
    assert single("NoNewPrivileges") == "yes"
    assert single("CapabilityBoundingSet") == ""  # empty: no capability at all
    assert single("RestrictAddressFamilies").split() == ["AF_INET", "AF_INET6", "AF_UNIX"]
    for key in (
        "PrivateDevices",
        "ProtectKernelTunables",
        "ProtectKernelModules",
        "ProtectControlGroups",
        "RestrictNamespaces",
        "RestrictSUIDSGID",
        "LockPersonality",
        "MemoryDenyWriteExecute",
    ):
        assert single(key) == "yes", key
    assert service()["SystemCallFilter"][0] == "@system-service"


def test_the_unit_runs_narwhal_serve_with_its_config_token_and_state() -> None:
    exec_start = single("ExecStart").split()
    assert exec_start[:3] == [
        "/opt/narwhal/bin/narwhal-serve",
        "--config",
        "/etc/narwhal/narwhal.yaml",
    ]
    assert exec_start[3:] == ["$NARWHAL_ARGS"]  # --standby, --resume: from the environment file
    assert single("EnvironmentFile") == "/etc/narwhal/narwhal.env"  # NARWHAL_ADMIN_TOKEN=...
    state = single("StateDirectory")
    assert single("WorkingDirectory") == f"/var/lib/{state}"  # relative state paths land there
    assert "2" in single("RestartPreventExitStatus").split()  # a config error: do not loop
    assert single("Restart") == "on-failure"
    # SIGTERM lets running requests finish within serving.shutdown_grace_s; systemd must wait
    # longer than that before SIGKILL.
    grace = ServingConfig().shutdown_grace_s
    assert seconds(single("TimeoutStopSec")) > grace + 2
    assert directives(UNIT.read_text())["Install"]["WantedBy"] == ["multi-user.target"]


def _scratch_root(tmp_path: Path, unit_text: str) -> Path:
    root = tmp_path / "root"
    shutil.copytree(SYSTEM_UNITS, root / SYSTEM_UNITS.relative_to("/"), symlinks=True)
    (root / "etc/systemd/system").mkdir(parents=True)
    (root / "etc/systemd/system/narwhal.service").write_text(unit_text)
    binary = root / single("ExecStart").split()[0].lstrip("/")
    binary.parent.mkdir(parents=True)
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    (root / "etc/narwhal").mkdir(parents=True)
    (root / "etc/narwhal/narwhal.env").write_text("NARWHAL_ADMIN_TOKEN=x\nNARWHAL_ARGS=\n")
    return root


def _verify(root: Path) -> subprocess.CompletedProcess[str]:
    assert ANALYZE is not None
    return subprocess.run(
        [
            ANALYZE,
            "verify",
            "--man=no",
            f"--root={root}",
            f"{root}/etc/systemd/system/narwhal.service",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.skipif(ANALYZE is None or not SYSTEM_UNITS.is_dir(), reason="no systemd-analyze here")
def test_systemd_analyze_verify_accepts_the_unit_and_rejects_a_broken_copy(tmp_path: Path) -> None:
    text = UNIT.read_text()
    done = _verify(_scratch_root(tmp_path / "good", text))
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip() == "", done.stderr  # not even a warning (unknown key, bad value)

    # The check bites: a misspelt key and a bad value are reported.
    broken = text.replace("ProtectSystem=strict", "ProtectSytem=strict").replace(
        "ProtectHome=yes", "ProtectHome=maybe"
    )
    done = _verify(_scratch_root(tmp_path / "bad", broken))
    assert "Unknown key 'ProtectSytem'" in done.stderr
    assert "protect home value" in done.stderr


@pytest.mark.skipif(ANALYZE is None or not SYSTEM_UNITS.is_dir(), reason="no systemd-analyze here")
def test_systemd_analyze_security_rates_the_unit_ok(tmp_path: Path) -> None:
    assert ANALYZE is not None
    root = _scratch_root(tmp_path, UNIT.read_text())
    done = subprocess.run(
        [
            ANALYZE,
            "security",
            "--offline=yes",
            f"--root={root}",
            "--no-pager",
            f"{root}/etc/systemd/system/narwhal.service",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    match = re.search(r"Overall exposure level for narwhal\.service: (\d+\.\d+)", done.stdout)
    assert match, done.stdout + done.stderr
    assert float(match[1]) <= 2.0, done.stdout  # 1.4 when written; 10 is an unhardened unit
