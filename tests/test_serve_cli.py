"""`narwhal-serve` as a subprocess: exit status 2 for a bad config or bad arguments, 1 for a valid
config that cannot start, each with one clear line on stderr and never a traceback
(docs/configuration.md, "Exit status"); `--check-config` refuses what a start refuses, with
the same line; `--version`."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

import narwhal
from tests.e2e.test_readmission_support import Pki

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
    """`narwhal-serve` with its own temporary directory: a router killed by another test
    leaves its runtime directory in the shared one, and the next start removes it with a
    line of its own (a refusal's stderr would then be two lines)."""
    env = {k: v for k, v in os.environ.items() if k != "NARWHAL_ADMIN_TOKEN"}
    env["TMPDIR"] = str(cwd)
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


# --- --check-config runs the start-up checks: what a start refuses, it refuses alike ------------


def _file(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def _pki(tmp_path: Path) -> tuple[Path, Path, Path]:
    """Two self-signed certificates: (a's cert, a's key, b's key)."""
    pki = Pki(tmp_path / "pki")
    a, b = pki.ca("a"), pki.ca("b")
    return a, a.with_suffix(".key"), b.with_suffix(".key")


def _refusals() -> list[Any]:
    """(overrides built from tmp_path, extra flags, the key the line names)."""

    def under_a_file(section: str) -> Any:
        def build(tmp: Path) -> dict[str, Any]:
            blocker = _file(tmp, "not-a-directory", "")
            overrides: dict[str, Any] = {"lease": {"backend": "file"}}
            overrides[section] = {**overrides.get(section, {}), "path": f"{blocker}/s/x.json"}
            return overrides

        return build

    def mismatched_tls(tmp: Path) -> dict[str, Any]:
        cert, _, other_key = _pki(tmp)
        return {"tls": {"cert_file": str(cert), "key_file": str(other_key)}}

    return [
        pytest.param(lambda t: {"tls": {"cert_file": str(t / "no.pem"), "key_file":
                                        str(t / "no.key")}}, [], "tls.cert_file", id="tls-missing"),
        pytest.param(mismatched_tls, [], "tls.cert_file", id="tls-key-not-the-certificate's"),
        pytest.param(lambda t: {"engine": {"ca_file": _file(t, "ca.pem", "not a pem")}}, [],
                     "engine.ca_file", id="engine-ca-unloadable"),
        pytest.param(lambda t: {"admin": {"token_file": str(t / "no-token")}}, [],
                     "admin.token_file", id="admin-token-file-missing"),
        pytest.param(lambda t: {"auth": {"api_keys_file": str(t / "no-keys")}}, [],
                     "auth.api_keys_file", id="api-keys-file-missing"),
        pytest.param(lambda t: {"auth": {"api_keys_file": _file(t, "keys", "# none\n")}}, [],
                     "auth", id="api-keys-file-empty"),
        pytest.param(under_a_file("handoff"), [], "handoff.path", id="handoff-dir-uncreatable"),
        pytest.param(under_a_file("lease"), [], "lease.path", id="lease-dir-uncreatable"),
        pytest.param(lambda t: {"handoff": {"path": str(t)}}, [], "handoff.path",
                     id="handoff-path-is-a-directory"),
        pytest.param(lambda t: {"listen": "0.0.0.0:8080"}, [], "admin", id="public-no-token"),
        pytest.param(lambda t: {}, ["--listen", "0.0.0.0:8080"], "admin",
                     id="public-listen-flag-no-token"),
        pytest.param(lambda t: {}, ["--standby"], "lease.backend", id="standby-without-lease"),
    ]  # fmt: skip


@pytest.mark.parametrize(("overrides", "flags", "key"), _refusals())
def test_check_config_refuses_what_start_refuses_with_the_same_line(
    tmp_path: Path, overrides: Callable[[Path], dict[str, Any]], flags: list[str], key: str
) -> None:
    config = write(tmp_path, config_dict(tmp_path, **overrides(tmp_path)))
    before = sorted(tmp_path.rglob("*"))
    started = serve("--config", str(config), *flags, cwd=tmp_path)
    checked = serve("--check-config", str(config), *flags, cwd=tmp_path)
    assert (started.returncode, checked.returncode) == (2, 2), (started.stderr, checked.stderr)
    line = one_line(started)
    assert line.startswith(f"{PREFIX}config error: {key}: "), line
    assert one_line(checked) == line
    assert sorted(tmp_path.rglob("*")) == before, "a refused config must not create state"


def test_check_config_passes_a_config_that_starts_and_creates_nothing(tmp_path: Path) -> None:
    cert, key, _ = _pki(tmp_path)
    overrides = {
        "tls": {"cert_file": str(cert), "key_file": str(key)},
        "engine": {"ca_file": str(cert)},
        "admin": {"token_file": _file(tmp_path, "token", "s3cret\n")},
        "auth": {"api_keys_file": _file(tmp_path, "keys", "k1\n")},
        "lease": {"backend": "file", "path": str(tmp_path / "new" / "deeper" / "lease.json")},
    }
    config = write(tmp_path, config_dict(tmp_path, listen="0.0.0.0:8080", **overrides))
    before = sorted(tmp_path.rglob("*"))
    result = serve("--check-config", str(config), "--standby", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"config OK: {config} (2 engines)\n"
    assert sorted(tmp_path.rglob("*")) == before, "--check-config creates nothing"


# --- bad flags: exit 2, one line, no usage block ---------------------------------------------

BAD_FLAGS = [
    pytest.param(["--log-level", "LOUD", "--config", "x.yaml"], "--log-level", id="log-level"),
    pytest.param(["--log-format", "xml", "--config", "x.yaml"], "--log-format", id="log-format"),
    pytest.param(["--config", "x.yaml", "--demo"], "--demo", id="config-and-demo"),
    pytest.param(["--config"], "--config", id="config-without-file"),
    pytest.param(["--colour", "blue"], "--colour", id="unknown-flag"),
]


@pytest.mark.parametrize(("args", "flag"), BAD_FLAGS)
def test_a_bad_flag_exits_2_with_one_line(tmp_path: Path, args: list[str], flag: str) -> None:
    result = serve(*args, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    line = one_line(result)
    assert line.startswith(f"{PREFIX}error: "), line
    assert flag in line, line


def test_a_log_level_is_accepted_in_any_case(tmp_path: Path) -> None:
    config = write(tmp_path, config_dict(tmp_path))
    result = serve("--log-level", "debug", "--check-config", str(config), cwd=tmp_path)
    assert result.returncode == 0, result.stderr


def test_version_prints_the_installed_distribution_version(tmp_path: Path) -> None:
    result = serve("--version", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"narwhal-serve {narwhal.version()}\n"
    assert narwhal.version() != "unknown", "the test environment has Narwhal installed"


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
    import asyncio

    from narwhal.cli import demo, serve

    real_launch = demo._launch
    launched: list[asyncio.subprocess.Process] = []

    async def second_sim_fails(role: str, *extra: str) -> asyncio.subprocess.Process:
        bad = ["--port", "70000"] if len(launched) == 1 else []
        proc = await real_launch(role, *extra, *bad)
        launched.append(proc)
        return proc

    monkeypatch.setattr(demo, "_launch", second_sim_fails)
    assert serve._run(serve._demo("127.0.0.1:0")) == serve.EXIT_START
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["narwhal-serve: start-up failed: demo fleet: narwhal-sim (prefill) exited "
                   "before listening"], err  # fmt: skip
    assert len(launched) == 5
    assert all(p.returncode is not None for p in launched), "every sim stopped with the demo"


def test_a_demo_engine_that_cannot_be_launched_stops_those_launched_before_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A launch that raises (here: an executable that cannot be run) ends the demo with one
    line, and the sims already started are stopped, not left behind."""
    import asyncio

    from narwhal.cli import demo, serve

    real_launch = demo._launch
    launched: list[asyncio.subprocess.Process] = []

    async def second_launch_raises(role: str, *extra: str) -> asyncio.subprocess.Process:
        if launched:
            raise OSError(8, "Exec format error")
        proc = await real_launch(role, *extra)
        launched.append(proc)
        return proc

    monkeypatch.setattr(demo, "_launch", second_launch_raises)
    assert serve._run(serve._demo("127.0.0.1:0")) == serve.EXIT_START
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["narwhal-serve: start-up failed: demo fleet: [Errno 8] Exec format error"], err
    assert len(launched) == 1 and launched[0].returncode is not None, "the first sim stopped"


def test_the_router_runs_on_uvloop() -> None:
    """`narwhal-serve` runs its process on uvloop as the workers run on it (with `workers: 1`
    that process is the data plane; docs/performance-log.md has the A/B)."""
    import asyncio

    import uvloop

    from narwhal.cli import serve

    loops: list[type] = []

    async def record() -> None:
        loops.append(type(asyncio.get_running_loop()))

    assert serve._run(record()) == 0
    assert loops == [uvloop.Loop]
