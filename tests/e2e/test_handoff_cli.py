"""The handoff from the command line, run as real subprocesses.

`narwhal handoff show FILE` (an alias of `inspect`) and `narwhal handoff validate FILE
[--config CFG]` (`python -m narwhal.cli.operator`), offline: no router needed. `validate`
applies the resume rules (spec "Resume validation"): exit 0 and `valid: ...` for a document
`--resume` would apply; exit 1 and `invalid: <reason>` otherwise; exit 2 for a bad
configuration. Without `--config` only the document itself is checked, and a `note:` line says
the engine set was not.

`narwhal-serve --config CFG --resume` (`python -m narwhal.cli.serve`) in front of real
`narwhal-sim` processes: applies a matching handoff, refuses a tampered one and serves, and
without `--resume` ignores the file.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

from narwhal.clock import FakeClock
from narwhal.config import parse_config
from narwhal.control.lifecycle import Lifecycle
from narwhal.control.stages import consolidation_risk
from narwhal.fleet.events import GenerationSeen
from narwhal.fleet.holds import HoldName
from narwhal.fleet.reducer import Policy
from narwhal.fleet.store import Fleet
from narwhal.state.handoff import build_document
from tests.support.fleet import verify_all
from tests.support.ports import free_port
from tests.support.router import router_config
from tests.support.sim_process import SimFactory

ENGINES = [
    {"id": "p0", "url": "http://127.0.0.1:9001", "role": "prefill"},
    {"id": "p1", "url": "http://127.0.0.1:9002", "role": "prefill"},
    {"id": "d0", "url": "http://127.0.0.1:9101", "role": "decode"},
    {"id": "d1", "url": "http://127.0.0.1:9102", "role": "decode"},
]


def narwhal(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "narwhal.cli.operator", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def write_config(path: Path, engines: list[dict[str, Any]], tmp_path: Path) -> Path:
    data = router_config(engines, tmp_path, recovery={"failure_quarantine_s": 60.0})
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture
def files(tmp_path: Path) -> tuple[Path, Path, dict[str, Any]]:
    """A config file and a handoff written for it: p1 drained, d1 ejected and quarantined,
    p0 under inference verification, generations known, every engine verified."""
    config_path = write_config(tmp_path / "narwhal.yaml", ENGINES, tmp_path)
    config = parse_config(yaml.safe_load(config_path.read_text()))
    clock = FakeClock(wall=1_700_000_000.0)  # in the past: validate refuses future times
    fleet = verify_all(Fleet(config.engines, clock, Policy.of(config.recovery)))  # serving
    lifecycle = Lifecycle(fleet)
    now = clock.monotonic()
    lifecycle.hold(fleet.get("p1"), HoldName.OPERATOR_DRAIN, "operator request", now)
    lifecycle.hold(fleet.get("p0"), HoldName.INFERENCE_VERIFICATION, "kv_handoff streak", now)
    lifecycle.eject(fleet.get("d1"), "connection", "refused", now)
    fleet.apply(GenerationSeen("d0", 1_799_999_000.5), clock.monotonic())
    lease = {"backend": "file", "holder": "router-a", "epoch": 3}
    doc = build_document(fleet, 41, clock.wall(), "router-a", lease, consolidation_risk(fleet, now))
    handoff = tmp_path / "handoff.json"
    handoff.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    return config_path, handoff, doc


def test_show_prints_the_document(files: tuple[Path, Path, dict[str, Any]]) -> None:
    _, handoff, doc = files
    out = narwhal("handoff", "show", str(handoff))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "schema narwhal.handoff/1  sequence 41  written_at 1700000000.0"
    assert lines[1] == f"writer router-a pid {os.getpid()} lease epoch 3"
    assert lines[2] == "lease {'backend': 'file', 'holder': 'router-a', 'epoch': 3}"
    engine_lines = {line.split()[0]: line.split() for line in lines[4:8]}
    assert engine_lines["d1"][1:] == [
        "decode", "ejected=connection", "holds=failure_quarantine", "generation=None",
        "verified=True",
    ]  # fmt: skip
    assert engine_lines["p1"][1:] == [
        "prefill", "ejected=-", "holds=operator_drain", "generation=None",
        "verified=True",
    ]  # fmt: skip
    assert engine_lines["p0"][3] == "holds=inference_verification"
    assert engine_lines["d0"][4] == "generation=1799999000.5"
    assert f"consolidation risk {json.dumps(doc['consolidation_risk'])}" in lines
    assert f"counters {json.dumps(doc['counters'])}" in lines
    assert out.stderr == ""


def test_show_refuses_a_missing_or_unparsable_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.json"
    out = narwhal("handoff", "show", str(missing))
    assert out.returncode == 1
    assert out.stderr.strip() == f"narwhal: {missing}: no such file"
    garbage = tmp_path / "garbage.json"
    garbage.write_bytes(b'{"schema": "narwhal.hand')
    out = narwhal("handoff", "show", str(garbage))
    assert out.returncode == 1
    assert out.stderr.startswith(f"narwhal: {garbage}: not valid JSON: ")


V1 = '"schema": "narwhal.handoff/1", '
NOT_V1 = "schema None does not match 'narwhal.handoff/1'"


@pytest.mark.parametrize(
    ("content", "complaint"),
    [
        ("[]", "not a JSON object"),
        ("null", "not a JSON object"),
        ('{"engines": {"a": "x"}}', NOT_V1),
        ('{"writer": null}', NOT_V1),
        ('{"engines": {"a": {"holds": [1]}}}', NOT_V1),
        ("{" + V1 + '"engines": {"a": "x"}}', "fails the schema at "),
        ("{" + V1 + '"writer": null}', "fails the schema at "),
        ("{" + V1 + '"engines": {"a": {"holds": [1]}}}', "fails the schema at "),
    ],
)
def test_show_reports_a_damaged_document_not_a_traceback(
    tmp_path: Path, content: str, complaint: str
) -> None:
    """Valid JSON that is not a handoff: the complaint, exit 1 (it used to crash)."""
    damaged = tmp_path / "damaged.json"
    damaged.write_text(content)
    out = narwhal("handoff", "show", str(damaged))
    assert "Traceback" not in out.stderr
    assert out.returncode == 1
    assert out.stderr.startswith(f"narwhal: {damaged}: {complaint}")
    assert out.stdout == ""


def test_validate_accepts_a_matching_handoff(files: tuple[Path, Path, dict[str, Any]]) -> None:
    config_path, handoff, _ = files
    out = narwhal("handoff", "validate", str(handoff), "--config", str(config_path))
    assert (out.returncode, out.stdout) == (0, "valid: applied handoff sequence 41 from router-a\n")


def _added(engines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [*engines, {"id": "p9", "url": "http://127.0.0.1:9009", "role": "prefill"}]


def _moved(engines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e if e["id"] != "d0" else {**e, "url": "http://10.0.0.7:8000"} for e in engines]


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (_added, "engine set differs from the config: in config only ['p9'], in handoff only []"),
        (lambda es: es[:-1], "engine set differs from the config: in config only [], "
                             "in handoff only ['d1']"),
        (_moved, "engine set differs from the config: in config only ['d0'], "
                 "in handoff only ['d0']"),
    ],
    ids=["engine-added", "engine-removed", "url-changed"],
)  # fmt: skip
def test_validate_refuses_a_handoff_for_another_engine_set(
    files: tuple[Path, Path, dict[str, Any]], tmp_path: Path, change: Any, reason: str
) -> None:
    _, handoff, _ = files
    other = write_config(tmp_path / "other.yaml", change(ENGINES), tmp_path)
    out = narwhal("handoff", "validate", str(handoff), "--config", str(other))
    assert (out.returncode, out.stdout) == (1, f"invalid: {reason}\n")


def _resealed(raw: bytes, change: Any) -> bytes:
    """`change` applied to the parsed document, then a fresh checksum: damage only the
    impossible-value checks can see."""
    doc = orjson.loads(raw)
    change(doc)
    body = {k: v for k, v in doc.items() if k != "checksum"}
    digest = hashlib.sha256(orjson.dumps(body, option=orjson.OPT_SORT_KEYS)).hexdigest()
    return orjson.dumps({**body, "checksum": "sha256:" + digest})


def _from_the_future(raw: bytes) -> bytes:
    """Resealed with a written_at far ahead of any real clock: an impossible value."""
    return _resealed(raw, lambda doc: doc.update(written_at=4_000_000_000.0))


def _engine_missing(raw: bytes) -> bytes:
    """Resealed with d1 still in engine_set but gone from engines: inconsistent in itself."""
    return _resealed(raw, lambda doc: doc["engines"].pop("d1"))


DAMAGES = pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda raw: raw[: len(raw) // 3], "invalid: not valid JSON (truncated or corrupt): "),
        (lambda raw: raw.replace(b'"sequence": 41', b'"sequence": 42'),
         "invalid: checksum mismatch: the document was modified after it was written"),
        (lambda raw: raw.replace(b"narwhal.handoff/1", b"narwhal.handoff/2"),
         "invalid: schema 'narwhal.handoff/2' does not match 'narwhal.handoff/1'"),
        (lambda raw: raw.replace(b'"sequence": 41', b'"sequence": -1'),
         "invalid: fails the schema at sequence: -1 is less than the minimum of 1"),
        (lambda raw: None, "invalid: no handoff file"),
        (_from_the_future, "invalid: impossible values: written_at 4000000000.0 is in the future"),
        (_engine_missing, "invalid: impossible values: engines do not match engine_set"),
    ],
    ids=["truncated", "tampered", "schema-version", "schema-violation", "missing", "future",
         "engine-missing"],
)  # fmt: skip


def _damage(handoff: Path, damage: Any) -> None:
    damaged = damage(handoff.read_bytes())
    if damaged is None:
        handoff.unlink()
    else:
        handoff.write_bytes(damaged)


@DAMAGES
def test_validate_refuses_a_damaged_handoff_with_the_reason(
    files: tuple[Path, Path, dict[str, Any]], damage: Any, reason: str
) -> None:
    config_path, handoff, _ = files
    _damage(handoff, damage)
    out = narwhal("handoff", "validate", str(handoff), "--config", str(config_path))
    assert out.returncode == 1
    assert out.stdout.startswith(reason)
    assert out.stdout.count("\n") == 1


NOT_CHECKED = (
    "note: no --config: the engine set and kv_role permits were not checked "
    "against a configuration\n"
)


def test_validate_without_a_config_checks_what_needs_none(
    files: tuple[Path, Path, dict[str, Any]],
) -> None:
    """No --config: the document alone is checked, and the output says the engine set was
    not (so a handoff for any fleet passes)."""
    _, handoff, _ = files
    out = narwhal("handoff", "validate", str(handoff))
    assert out.returncode == 0, out.stderr
    assert out.stdout == "valid: applied handoff sequence 41 from router-a\n" + NOT_CHECKED
    assert out.stderr == ""


@DAMAGES
def test_validate_without_a_config_still_refuses_a_damaged_handoff(
    files: tuple[Path, Path, dict[str, Any]], damage: Any, reason: str
) -> None:
    _, handoff, _ = files
    _damage(handoff, damage)
    out = narwhal("handoff", "validate", str(handoff))
    assert out.returncode == 1, out.stderr
    first, second = out.stdout.splitlines(keepends=True)
    assert first.startswith(reason)
    assert second == NOT_CHECKED
    assert "Traceback" not in out.stderr


def test_validate_with_a_config_still_checks_kv_role_permits(
    files: tuple[Path, Path, dict[str, Any]], tmp_path: Path
) -> None:
    """A role the config's kv_role forbids is refused with --config and, having no config to
    judge it by, let through without one."""
    config_path, handoff, _ = files
    data = yaml.safe_load(config_path.read_text())
    for engine in data["engines"]:
        if engine["id"] == "p0":
            engine.update(role="decode", kv_role="kv_consumer")
    strict = tmp_path / "strict.yaml"
    strict.write_text(yaml.safe_dump(data))
    out = narwhal("handoff", "validate", str(handoff), "--config", str(strict))
    assert (out.returncode, out.stdout) == (
        1,
        "invalid: impossible values: p0 role prefill is not permitted by kv_role kv_consumer\n",
    )
    assert narwhal("handoff", "validate", str(handoff)).returncode == 0


@pytest.mark.parametrize("command", ["validate", "show"])
def test_an_unreadable_path_is_reported_not_a_traceback(
    files: tuple[Path, Path, dict[str, Any]], tmp_path: Path, command: str
) -> None:
    config_path, _, _ = files
    directory = tmp_path / "a-directory.json"
    directory.mkdir()
    extra = ["--config", str(config_path)] if command == "validate" else []
    out = narwhal("handoff", command, str(directory), *extra)
    assert out.returncode == 1
    assert "Traceback" not in out.stderr
    if command == "validate":
        assert out.stdout.startswith("invalid: ")
    else:
        assert out.stderr.startswith(f"narwhal: {directory}: ")


def test_validate_with_a_bad_config_is_a_usage_error(
    files: tuple[Path, Path, dict[str, Any]], tmp_path: Path
) -> None:
    _, handoff, _ = files
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: m\nengines: []\nbogus: 1\n")
    out = narwhal("handoff", "validate", str(handoff), "--config", str(bad))
    assert out.returncode == 2
    assert out.stdout == ""
    assert out.stderr.startswith("narwhal: config error: ")


# --------------------------------------------------------------------------- narwhal-serve
def http_get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()
    except (urllib.error.URLError, OSError):
        return 0, ""


def wait_for(probe: Any, what: str, timeout_s: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        result = probe()
        if result:
            return result
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def served(sim_factory: SimFactory, tmp_path: Path) -> Iterator[Any]:
    """`serve(*flags)` runs `narwhal-serve --config CFG *flags` on a free port; p0 is drained
    in the saved handoff, so an applied resume leaves no prefill capacity."""
    prefill, decode = sim_factory.start_many(
        [["--role", "prefill", "--kv-role", "kv_producer"],
         ["--role", "decode", "--kv-role", "kv_consumer"]]
    )  # fmt: skip
    engines = [
        {"id": "p0", "url": prefill.url, "role": "prefill"},
        {"id": "d0", "url": decode.url, "role": "decode"},
    ]
    port = free_port()
    data = router_config(engines, tmp_path, listen=f"127.0.0.1:{port}")
    config_path = tmp_path / "narwhal.yaml"
    config_path.write_text(yaml.safe_dump(data))
    config = parse_config(data)
    fleet = Fleet(config.engines, FakeClock())
    Lifecycle(fleet).hold(fleet.get("p0"), HoldName.OPERATOR_DRAIN, "operator request", 0.0)
    doc = build_document(fleet, 41, time.time(), "router-a", None, {})
    handoff = Path(config.handoff.path)
    handoff.parent.mkdir(parents=True)
    handoff.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    procs: list[subprocess.Popen[bytes]] = []

    def serve(*flags: str) -> tuple[str, Path]:
        log = tmp_path / f"serve{len(procs)}.log"
        command = [sys.executable, "-m", "narwhal.cli.serve", "--config", str(config_path)]
        with log.open("wb") as out:
            procs.append(
                subprocess.Popen(
                    [*command, *flags],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                )
            )
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: http_get(url + "/health")[0] == 200, "narwhal-serve to listen")
        return url, log

    try:
        yield serve, handoff
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def test_narwhal_serve_resume_applies_a_matching_handoff(served: Any) -> None:
    serve, handoff = served
    url, log = serve("--resume")
    engines = json.loads(http_get(url + "/admin/engines")[1])["engines"]
    p0 = next(e for e in engines if e["id"] == "p0")
    assert p0["holds"] == ["operator_drain"]
    assert http_get(url + "/ready") == (503, "no capacity: prefill")
    assert "resume: applied handoff sequence 41 from router-a" in log.read_text()
    metrics = http_get(url + "/metrics")[1]
    assert 'narwhal_handoff_resume_total{result="applied"} 1.0' in metrics
    wait_for(lambda: json.loads(handoff.read_bytes())["sequence"] > 41, "sequence 42+")


def test_narwhal_serve_resume_refuses_a_tampered_handoff_and_serves(served: Any) -> None:
    serve, handoff = served
    handoff.write_bytes(handoff.read_bytes().replace(b"operator request", b"operator whim"))
    url, log = serve("--resume")
    wait_for(lambda: http_get(url + "/ready") == (200, "ready"), "readiness")
    engines = json.loads(http_get(url + "/admin/engines")[1])["engines"]
    assert all(e["holds"] == [] for e in engines)
    expected = (
        "resume: starting fresh: checksum mismatch: the document was modified after it was written"
    )
    assert expected in log.read_text()
    assert 'narwhal_handoff_resume_total{result="refused"} 1.0' in http_get(url + "/metrics")[1]


def test_narwhal_serve_without_resume_ignores_the_saved_handoff(served: Any) -> None:
    serve, _ = served
    url, log = serve()
    wait_for(lambda: http_get(url + "/ready") == (200, "ready"), "readiness")
    assert "resume:" not in log.read_text()
    assert "narwhal_handoff_resume_total{" not in http_get(url + "/metrics")[1]
    engines = json.loads(http_get(url + "/admin/engines")[1])["engines"]
    assert all(e["holds"] == [] for e in engines)
