"""`narwhal-serve` as a subprocess: exit status 2 for a bad config or bad arguments, 1 for a valid
config that cannot start, each with one clear line on stderr and never a traceback
(docs/configuration.md, "Exit status")."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

PREFIX = "narwhal-serve: "


def config_dict(tmp_path: Path, **overrides: Any) -> dict[str, Any]:
    """A valid config: loopback listen, engines that are never contacted, state in tmp_path."""
    return {
        "model": "demo-model",
        "listen": "127.0.0.1:0",
        "engines": [
            {"id": "p0", "url": "http://127.0.0.1:9001", "role": "prefill"},
            {"id": "d0", "url": "http://127.0.0.1:9101", "role": "decode"},
        ],
        "handoff": {"path": str(tmp_path / "state" / "handoff.json")},
        **overrides,
    }


def write(tmp_path: Path, data: dict[str, Any] | str) -> Path:
    path = tmp_path / "narwhal.yaml"
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data, sort_keys=False))
    return path


def serve(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "NARWHAL_ADMIN_TOKEN"}
    return subprocess.run(
        [sys.executable, "-m", "narwhal.cli.serve", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=cwd,
        env=env,
        check=False,
    )


def one_line(result: subprocess.CompletedProcess[str]) -> str:
    """The single stderr line of a refusal; nothing on stdout, no traceback."""
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert result.stdout == ""
    assert lines[0].startswith(PREFIX), lines[0]
    return lines[0]


# --- exit 2: the config or the arguments are wrong ------------------------------------------------

BAD_CONFIG = [
    pytest.param({"serving": {"max_connections": 0}}, "serving.max_connections", id="zero"),
    pytest.param({"colour": "blue"}, "colour", id="unknown-key"),
    pytest.param({"lease": {"ttl_s": 2, "renew_interval_s": 2}}, "lease.renew_interval_s",
                 id="lease-timing"),
    pytest.param({"listen": "0.0.0.0:8080"}, "admin", id="public-listen-without-token"),
    pytest.param("model: a\nmodel: b\n", "model", id="duplicate-key"),
    pytest.param("serving: {? [a, b] : 1}\n", "serving", id="list-as-key"),
]  # fmt: skip


@pytest.mark.parametrize(("source", "key"), BAD_CONFIG)
def test_run_with_a_bad_config_exits_2(
    tmp_path: Path, source: dict[str, Any] | str, key: str
) -> None:
    data = source if isinstance(source, str) else config_dict(tmp_path, **source)
    result = serve("--config", str(write(tmp_path, data)), cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert one_line(result).startswith(f"{PREFIX}config error: {key}: "), result.stderr
    assert not (tmp_path / "state").exists(), "a refused config must not create state"


@pytest.mark.parametrize("listen", ["localhost", "127.0.0.1:65536", ":8080"])
def test_a_bad_listen_flag_exits_2(tmp_path: Path, listen: str) -> None:
    config = write(tmp_path, config_dict(tmp_path))
    result = serve("--config", str(config), "--listen", listen, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert one_line(result).startswith(f"{PREFIX}config error: listen: "), result.stderr


def test_standby_without_a_lease_exits_2(tmp_path: Path) -> None:
    config = write(tmp_path, config_dict(tmp_path))  # no lease section: backend none
    result = serve("--config", str(config), "--standby", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    line = one_line(result)
    assert line.startswith(f"{PREFIX}config error: lease.backend: "), line
    assert "--standby" in line


def test_no_arguments_exits_2(tmp_path: Path) -> None:
    result = serve(cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    line = one_line(result)
    assert all(flag in line for flag in ("--config", "--check-config", "--demo")), line


# --- exit 1: a valid config that cannot start ----------------------------------------------------


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A loopback port with a listener on it for the duration of the test."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_a_listen_port_in_use_exits_1_naming_the_address(tmp_path: Path, busy_port: int) -> None:
    config = write(tmp_path, config_dict(tmp_path, listen=f"127.0.0.1:{busy_port}"))
    result = serve("--config", str(config), cwd=tmp_path)
    assert result.returncode == 1, result.stderr
    line = one_line(result)
    assert line.startswith(f"{PREFIX}start-up failed: "), line
    assert str(busy_port) in line and "in use" in line, line


def test_a_listen_host_that_does_not_resolve_exits_1(tmp_path: Path) -> None:
    config = write(tmp_path, config_dict(tmp_path, admin={"token": "t"}))
    result = serve("--config", str(config), "--listen", "nowhere.invalid:8080", cwd=tmp_path)
    assert result.returncode == 1, result.stderr
    assert one_line(result).startswith(f"{PREFIX}start-up failed: listen nowhere.invalid:8080: ")


@pytest.mark.parametrize("key", ["handoff.path", "lease.path"])
def test_a_state_directory_that_cannot_be_created_exits_1(tmp_path: Path, key: str) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")  # a file where the state directory should be (refused even for root)
    section = key.split(".")[0]
    overrides: dict[str, Any] = {"lease": {"backend": "file"}}
    overrides[section] = {**overrides.get(section, {}), "path": str(blocker / "s" / "x.json")}
    config = write(tmp_path, config_dict(tmp_path, **overrides))
    result = serve("--config", str(config), cwd=tmp_path)
    assert result.returncode == 1, result.stderr
    line = one_line(result)
    assert line.startswith(f"{PREFIX}start-up failed: {key}: "), line
    assert str(blocker / "s") in line, line


def test_a_file_lease_directory_is_created_at_start(tmp_path: Path, busy_port: int) -> None:
    # The lease directory exists before the router binds: a busy port stops it right after.
    lease = {"path": str(tmp_path / "lease-dir" / "lease.json")}  # backend: file by default
    config = write(tmp_path, config_dict(tmp_path, listen=f"127.0.0.1:{busy_port}", lease=lease))
    result = serve("--config", str(config), cwd=tmp_path)
    assert result.returncode == 1, result.stderr
    assert (tmp_path / "lease-dir").is_dir()


def test_a_demo_engine_that_cannot_start_is_a_one_line_start_up_failure(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A demo sim that exits before listening (here: a real narwhal-sim given a port it
    refuses) ends the demo with exit status 1 and one line, and stops the sims it started."""
    from contextlib import AsyncExitStack

    from narwhal.cli import demo, serve

    real_start_sim = demo.start_sim
    started: list[str] = []

    async def second_sim_fails(stack: AsyncExitStack, role: str, extra: list[str]) -> str:
        bad = ["--port", "70000"] if started else []
        url = await real_start_sim(stack, role, [*extra, *bad])
        started.append(url)
        return url

    monkeypatch.setattr(demo, "start_sim", second_sim_fails)
    assert serve._run(serve._demo("127.0.0.1:0")) == serve.EXIT_START
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["narwhal-serve: start-up failed: demo fleet: narwhal-sim (prefill) exited "
                   "before listening"], err  # fmt: skip
    (url,) = started
    port = int(url.rsplit(":", 1)[1])
    with socket.socket() as s:  # the first sim was stopped with the demo
        assert s.connect_ex(("127.0.0.1", port)) != 0
