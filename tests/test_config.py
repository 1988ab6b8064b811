"""The configuration contract (DESIGN §6, docs/configuration.md).

- the annotated example loads, and every default is what the docs say;
- a table of bad configurations, each refused with a problem line that names the exact key;
- lease timing derivation;
- `narwhal-serve --check-config` as a subprocess: exit 0 / exit 2, problems on stderr, no traceback.
"""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel, ValidationError

from narwhal.config import Config, ConfigError, KvRole, Role, load_config, parse_config

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "narwhal.yaml"
DOCS = ROOT / "docs" / "configuration.md"

CLI_PREFIX = "narwhal-serve: config error: "
_KEY = re.compile(r"\(file\)|\(top level\)|[a-z_]+(\[\d+\])?(\.[a-z_]+(\[\d+\])?)*")

MINIMAL: dict[str, Any] = {
    "model": "demo-model",
    "engines": [
        {"id": "p0", "url": "http://127.0.0.1:9001", "role": "prefill"},
        {"id": "d0", "url": "http://127.0.0.1:9101", "role": "decode"},
    ],
}

# The base of the bad-config table: valid, two engines of each role, lease backend `file`.
BASE: dict[str, Any] = {
    "model": "demo-model",
    "engines": [
        {"id": "p0", "url": "http://127.0.0.1:9001", "role": "prefill"},
        {"id": "p1", "url": "http://127.0.0.1:9002", "role": "prefill"},
        {"id": "d0", "url": "http://127.0.0.1:9101", "role": "decode"},
        {"id": "d1", "url": "http://127.0.0.1:9102", "role": "decode"},
    ],
    "lease": {"backend": "file", "ttl_s": 10, "renew_interval_s": 2},
    "admin": {"token_env": "NARWHAL_ADMIN_TOKEN"},
}


def keys_of(problems: list[str]) -> list[str]:
    """The key named at the start of each `key: message` problem line."""
    return [p.split(": ", 1)[0] for p in problems]


# --- editing a config by key path ----------------------------------------------------------------

DELETE = object()
_STEP = re.compile(r"([A-Za-z_]\w*)|\[(\d+)\]")


def _steps(path: str) -> list[str | int]:
    steps: list[str | int] = []
    for name, index in _STEP.findall(path):
        steps.append(int(index) if index else name)
    return steps


def edited(base: dict[str, Any], edits: dict[str, Any]) -> dict[str, Any]:
    """A deep copy of `base` with each `key.path[i].leaf: value` set (or removed with DELETE)."""
    data = copy.deepcopy(base)
    for path, value in edits.items():
        *parents, leaf = _steps(path)
        node: Any = data
        for step in parents:
            node = node.setdefault(step, {}) if isinstance(step, str) else node[step]
        if value is DELETE:
            del node[leaf]
        else:
            node[leaf] = value
    return data


@dataclass(frozen=True)
class Raw:
    """A config file given as text, for what a mapping cannot express."""

    text: str


def write_config(tmp_path: Path, source: dict[str, Any] | Raw, name: str = "narwhal.yaml") -> Path:
    path = tmp_path / name
    if isinstance(source, Raw):
        path.write_text(source.text)
    else:
        path.write_text(yaml.safe_dump(edited(BASE, source), sort_keys=False))
    return path


# --- (a) the example and the defaults ------------------------------------------------------------


def test_example_loads() -> None:
    cfg = load_config(EXAMPLE)
    assert cfg.model == "demo-model"
    assert cfg.router_id == "router-a"
    assert (cfg.listen_host, cfg.listen_port) == ("127.0.0.1", 8080)
    assert [(e.id, e.url, e.role, e.effective_kv_role) for e in cfg.engines] == [
        ("p0", "http://127.0.0.1:9001", Role.PREFILL, KvRole.PRODUCER),
        ("p1", "http://127.0.0.1:9002", Role.PREFILL, KvRole.PRODUCER),
        ("d0", "http://127.0.0.1:9101", Role.DECODE, KvRole.CONSUMER),
        ("d1", "http://127.0.0.1:9102", Role.DECODE, KvRole.CONSUMER),
    ]
    assert cfg.lease.backend == "file"
    assert cfg.lease.ttl_s > cfg.lease.effective_renew_deadline_s > cfg.lease.renew_interval_s
    assert (cfg.admin.token, cfg.admin.token_env, cfg.admin.token_file) == (
        None,
        "NARWHAL_ADMIN_TOKEN",
        None,
    )


def test_example_admin_token_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = load_config(EXAMPLE)
    monkeypatch.setenv("NARWHAL_ADMIN_TOKEN", "s3cret")
    assert cfg.admin.resolve_token() == "s3cret"
    monkeypatch.delenv("NARWHAL_ADMIN_TOKEN")
    assert cfg.admin.resolve_token() is None


def _documented_keys(model: type[BaseModel], prefix: str = "") -> Iterator[str]:
    """Every leaf key of the config model, engines written as `engines[].id`."""
    for name, field in model.model_fields.items():
        ann = field.annotation
        args = typing.get_args(ann)
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            yield f"{prefix}{name}"
            yield from _documented_keys(ann, f"{prefix}{name}.")
        elif args and isinstance(args[0], type) and issubclass(args[0], BaseModel):
            # A list of sections (`engines[].id`), or one optional section (`x.y`).
            many = typing.get_origin(ann) in (list, tuple)
            yield f"{prefix}{name}"
            yield from _documented_keys(args[0], f"{prefix}{name}{'[].' if many else '.'}")
        else:
            yield f"{prefix}{name}"


_ROW = re.compile(r"^\| `([a-z_\[\].]+)` \| ([^|]+) \| ([^|]+) \|", re.M)


def _doc_rows() -> dict[str, tuple[str, str]]:
    return {m[1]: (m[2].strip(), m[3].strip()) for m in _ROW.finditer(DOCS.read_text())}


def _value_at(cfg: Config, key: str) -> Any:
    node: Any = cfg
    for part in key.split("."):
        node = getattr(node, part[:-2])[0] if part.endswith("[]") else getattr(node, part)
    return list(node) if isinstance(node, tuple) else node


# Defaults the docs state in words, because they are derived from other keys; each is checked below.
DERIVED = {
    "router_id",
    "engines[].kv_role",
    "engines[].model",
    "lease.renew_deadline_s",
    "lease.backend",
}


def test_every_key_is_documented_and_in_the_example() -> None:
    rows = _doc_rows()
    example = EXAMPLE.read_text()
    keys = list(_documented_keys(Config))
    assert sorted(set(keys) - set(rows)) == [], "keys missing from docs/configuration.md"
    assert sorted(set(rows) - set(keys)) == [], "docs/configuration.md documents unknown keys"
    for key in keys:
        leaf = key.rsplit(".", 1)[-1].removesuffix("[]")
        # Set, or shown commented out, with an explanation nearby.
        assert re.search(rf"^\s*#?\s*(- )?{leaf}:", example, re.M), f"{key} not in the example"


# The minimal config with one DNS source: the base for the `discovery.dns[]` rows.
WITH_DNS = {**MINIMAL, "discovery": {"dns": [{"name": "engines.test", "role": "decode"}]}}


def test_defaults_are_as_documented() -> None:
    fields = {k: None for k in _documented_keys(Config)}
    checked = 0
    for key, (_type, default) in _doc_rows().items():
        assert key in fields
        base = WITH_DNS if key.startswith("discovery.dns[]") else MINIMAL
        if key.startswith("engines[].kv_events."):  # an optional section: judged when set
            base = edited(MINIMAL, {"engines[0].kv_events": {"endpoint": "tcp://127.0.0.1:1"}})
        cfg = parse_config(base)
        literal = re.fullmatch(r"`([^`]*)`", default)
        if literal:
            assert _value_at(cfg, key) == yaml.safe_load(literal[1]), key
            checked += 1
        elif default == "not set":
            assert _value_at(cfg, key) is None, key
        elif default == "required":
            with pytest.raises(ConfigError) as info:
                parse_config(edited(base, {key.replace("[]", "[0]"): DELETE}))
            assert keys_of(info.value.problems) == [key.replace("[]", "[0]")]
        elif default == "see below":
            assert isinstance(_value_at(cfg, key), BaseModel), key
        else:
            assert key in DERIVED, f"{key}: default {default!r} is neither a literal nor derived"
    assert checked >= 25


def test_derived_defaults() -> None:
    cfg = parse_config(MINIMAL)
    assert {e.model for e in cfg.engines} == {cfg.model}  # an engine without one: the default
    own = edited(MINIMAL, {"engines[0].model": "other"})
    assert parse_config(own).engines[0].model == "other"
    assert cfg.serving.migrations == 0  # single_attempt never migrates
    bounded = parse_config({**MINIMAL, "serving": {"policy": "bounded"}})
    assert bounded.serving.migrations == 2
    limited = {"policy": "bounded", "migration_limit": 0}
    assert parse_config({**MINIMAL, "serving": limited}).serving.migrations == 0
    assert cfg.router_id is None
    assert cfg.effective_router_id == cfg.listen == "127.0.0.1:8080"
    assert cfg.lease.effective_renew_deadline_s == pytest.approx(0.75 * cfg.lease.ttl_s)
    # `file` is the embedded lease backend once a lease section is given; none without one.
    assert cfg.lease.backend == "none"
    assert parse_config({**MINIMAL, "lease": {}}).lease.backend == "file"
    timings_only = {"ttl_s": 5, "renew_interval_s": 1}
    assert parse_config({**MINIMAL, "lease": timings_only}).lease.backend == "file"
    both = parse_config(
        edited(MINIMAL, {"engines": [{"id": "b0", "url": "http://127.0.0.1:9001", "role": "both"}]})
    )
    assert [e.effective_kv_role for e in (*cfg.engines, *both.engines)] == [
        KvRole.PRODUCER,
        KvRole.CONSUMER,
        KvRole.BOTH,
    ]


@pytest.mark.parametrize(
    ("role", "kv_role"),
    [
        ("prefill", "kv_producer"),
        ("prefill", "kv_both"),
        ("decode", "kv_consumer"),
        ("decode", "kv_both"),
    ],
)
def test_kv_roles_that_permit_the_role(role: str, kv_role: str) -> None:
    i = 0 if role == "prefill" else 1  # MINIMAL's prefill and decode engine
    cfg = parse_config(edited(MINIMAL, {f"engines[{i}].kv_role": kv_role}))
    assert (cfg.engines[i].role, cfg.engines[i].effective_kv_role) == (role, kv_role)


def test_embed_engines_transfer_no_kv_and_may_front_alone() -> None:
    """A router of embed engines only serves embeddings only; their kv_role is `kv_none`."""
    embed = {"id": "e0", "url": "http://127.0.0.1:9301", "role": "embed"}
    cfg = parse_config({"model": "bge", "engines": [embed]})
    assert cfg.engines[0].effective_kv_role is KvRole.NONE
    assert cfg.engines[0].model == "bge"


def test_config_is_frozen() -> None:
    cfg = parse_config(MINIMAL)
    with pytest.raises(ValidationError):
        cfg.serving.max_connections = 1  # type: ignore[misc]


def test_url_and_listen_normalisation() -> None:
    cfg = parse_config(
        edited(MINIMAL, {"engines[0].url": "https://prefill.example:8443/", "listen": "[::1]:9000"})
    )
    assert cfg.engines[0].url == "https://prefill.example:8443"
    assert (cfg.listen_host, cfg.listen_port) == ("::1", 9000)


# --- (b) bad configs: every problem names its key ------------------------------------------------

BAD = [
    # Unknown keys, at the top level, in every section and in an engine entry.
    pytest.param({"colour": "blue"}, "colour", "unknown key", id="unknown-top-level"),
    pytest.param({"serving.max_conections": 5}, "serving.max_conections", "unknown key",
                 id="unknown-serving"),
    pytest.param({"engine.health_timeout": 1}, "engine.health_timeout", "unknown key",
                 id="unknown-engine-section"),
    pytest.param({"controller.monitor_interval": 1}, "controller.monitor_interval", "unknown key",
                 id="unknown-controller"),
    pytest.param({"recovery.eject_afer": 3}, "recovery.eject_afer", "unknown key",
                 id="unknown-recovery"),
    pytest.param({"handoff.dir": "state"}, "handoff.dir", "unknown key", id="unknown-handoff"),
    pytest.param({"lease.ttl": 10}, "lease.ttl", "unknown key", id="unknown-lease"),
    pytest.param({"standby.threshold": 3}, "standby.threshold", "unknown key",
                 id="unknown-standby"),
    pytest.param({"admin.password": "x"}, "admin.password", "unknown key", id="unknown-admin"),
    pytest.param({"engines[2].weight": 2}, "engines[2].weight", "unknown key",
                 id="unknown-engine-entry"),
    # Wrong types: nothing is coerced.
    pytest.param({"serving.max_connections": "256"}, "serving.max_connections", "valid integer",
                 id="string-for-int"),
    pytest.param({"controller.monitor_failure_limit": 2.5}, "controller.monitor_failure_limit",
                 "valid integer", id="float-for-int"),
    pytest.param({"serving.request_timeout_s": True}, "serving.request_timeout_s", "valid number",
                 id="bool-for-float"),
    pytest.param({"recovery.eject_after": True}, "recovery.eject_after", "valid integer",
                 id="bool-for-int"),
    pytest.param({"serving": [256, 60]}, "serving", "valid dictionary", id="list-for-mapping"),
    pytest.param({"lease": None}, "lease", "valid dictionary", id="null-section"),
    pytest.param({"engines[0]": "p0"}, "engines[0]", "valid dictionary", id="string-for-engine"),
    pytest.param({"engines": {"p0": {"url": "http://127.0.0.1:9001"}}}, "engines", "",
                 id="mapping-for-engine-list"),
    pytest.param({"model": 7}, "model", "valid string", id="int-for-model"),
    pytest.param({"lease.endpoints": "http://127.0.0.1:2379"}, "lease.endpoints", "",
                 id="string-for-list"),
    # Zero and negative numbers.
    pytest.param({"serving.max_connections": 0}, "serving.max_connections", "greater than 0",
                 id="zero-max-connections"),
    pytest.param({"serving.queue_limit": -1}, "serving.queue_limit", "greater than or equal to 0",
                 id="negative-queue-limit"),
    pytest.param({"engine.health_timeout_s": -1.0}, "engine.health_timeout_s", "greater than 0",
                 id="negative-health-timeout"),
    pytest.param({"controller.monitor_interval_s": 0}, "controller.monitor_interval_s",
                 "greater than 0", id="zero-monitor-interval"),
    pytest.param({"recovery.failure_quarantine_s": 0}, "recovery.failure_quarantine_s",
                 "greater than 0", id="zero-quarantine"),
    pytest.param({"lease.ttl_s": -10}, "lease.ttl_s", "greater than 0", id="negative-ttl"),
    pytest.param({"standby.takeover_threshold": 0}, "standby.takeover_threshold",
                 "greater than 0", id="zero-takeover-threshold"),
    # The fleet.
    pytest.param({"engines[3].id": "p0"}, "engines[3].id", "duplicate engine id",
                 id="duplicate-engine-id"),
    pytest.param({"engines[3].url": "http://127.0.0.1:9001/"}, "engines[3].url",
                 "duplicate engine url", id="duplicate-engine-url"),
    pytest.param({"engines[0].url": "127.0.0.1:9001"}, "engines[0].url", "http://",
                 id="url-without-scheme"),
    pytest.param({"engines[1].url": "ftp://127.0.0.1:9002"}, "engines[1].url", "http://",
                 id="url-ftp"),
    pytest.param({"engines[2].url": "http://127.0.0.1:9101/v1"}, "engines[2].url", "path",
                 id="url-with-path"),
    pytest.param({"engines[2].url": "http://127.0.0.1:9101?x=1"}, "engines[2].url", "query",
                 id="url-with-query"),
    pytest.param({"engines[3].url": "http://127.0.0.1:99999"}, "engines[3].url", "bad port",
                 id="url-port-out-of-range"),
    pytest.param({"engines[3].url": "http://127.0.0.1:http"}, "engines[3].url", "bad port",
                 id="url-port-not-a-number"),
    pytest.param({"engines[0].url": "http://:9001"}, "engines[0].url", "no host",
                 id="url-without-host"),
    pytest.param({"engines[0].role": "encode"}, "engines[0].role", "must be one of",
                 id="unknown-role"),
    pytest.param({"engines[0].kv_role": "kv_sender"}, "engines[0].kv_role", "must be one of",
                 id="unknown-kv-role"),
    pytest.param({"engines[0].kv_role": "kv_consumer"}, "engines[0].kv_role",
                 "does not permit role prefill", id="consumer-cannot-prefill"),
    pytest.param({"engines[2].kv_role": "kv_producer"}, "engines[2].kv_role",
                 "does not permit role decode", id="producer-cannot-decode"),
    pytest.param({"engines[0].role": "both", "engines[0].kv_role": "kv_producer"},
                 "engines[0].kv_role", "does not permit role both", id="producer-cannot-be-both"),
    pytest.param({"engines[2].role": "prefill", "engines[3].role": "prefill"}, "engines",
                 "no engine has role decode", id="no-decode-engine"),
    pytest.param({"engines[3].role": "embed"}, "engines[3].role",
                 "model 'demo-model' is served by generative engines already",
                 id="embed-and-generative-engines-of-one-model"),
    pytest.param({"engines[2].role": "embed", "engines[2].model": "e",
                  "engines[3].role": "embed", "engines[3].model": "e"}, "engines",
                 "no engine has role decode", id="embed-engines-are-no-decode-engines"),
    pytest.param({"engines[0].role": "embed", "engines[0].kv_role": "kv_producer"},
                 "engines[0].kv_role", "does not permit role embed", id="embed-with-a-kv-role"),
    pytest.param({"engines[0].kv_role": "kv_none"}, "engines[0].kv_role",
                 "does not permit role prefill", id="kv-none-cannot-prefill"),
    pytest.param({"engines[0].role": "decode", "engines[1].role": "decode"}, "engines",
                 "no engine has role prefill", id="no-prefill-engine"),
    pytest.param({"engines": []}, "engines", "at least one engine", id="no-engines"),
    pytest.param({"engines": DELETE}, "engines", "required", id="missing-engines"),
    pytest.param({"engines[1].url": DELETE}, "engines[1].url", "required",
                 id="missing-engine-url"),
    pytest.param({"engines[0].id": "-p0"}, "engines[0].id", "pattern", id="bad-engine-id"),
    pytest.param({"engines[0].api": "sglang"}, "engines[0].api", "llamacpp", id="unknown-api"),
    pytest.param({"engines[1].api": "llamacpp"}, "engines[1].api", "one engine API",
                 id="mixed-engine-apis"),
    pytest.param({"engines[0].slot_save_path": "/slots"}, "engines[0].slot_save_path",
                 "only engines with api llamacpp", id="slot-path-for-vllm"),
    pytest.param({"engines[0].api": "llamacpp", "engines[1].api": "llamacpp",
                  "engines[2].api": "llamacpp", "engines[3].api": "llamacpp",
                  "engines[0].slot_save_path": ""}, "engines[0].slot_save_path",
                 "at least 1 character", id="empty-slot-path"),
    pytest.param({"engines[0].api_key": "k", "engines[0].api_key_env": "K"}, "engines[0].api_key",
                 "not both", id="two-engine-api-keys"),
    # Contradictory timings.
    pytest.param({"lease.renew_interval_s": 10}, "lease.renew_interval_s", "below ttl_s",
                 id="renew-interval-equals-ttl"),
    pytest.param({"lease.renew_interval_s": 15}, "lease.renew_interval_s", "below ttl_s",
                 id="renew-interval-above-ttl"),
    pytest.param({"lease.renew_deadline_s": 10}, "lease.renew_deadline_s", "below ttl_s",
                 id="renew-deadline-equals-ttl"),
    pytest.param({"lease.renew_deadline_s": 2}, "lease.renew_deadline_s",
                 "exceed renew_interval_s", id="renew-deadline-not-above-interval"),
    pytest.param({"serving.first_token_timeout_s": 61}, "serving.first_token_timeout_s",
                 "request_timeout_s", id="first-token-after-request-deadline"),
    pytest.param({"serving.stream_idle_timeout_s": 90}, "serving.stream_idle_timeout_s",
                 "request_timeout_s", id="stream-idle-after-request-deadline"),
    pytest.param({"serving.request_timeout_s": 8}, "serving.first_token_timeout_s",
                 "request_timeout_s", id="request-deadline-below-default-first-token"),
    pytest.param({"serving.migration_limit": 1}, "serving.migration_limit", "single_attempt",
                 id="migration-under-single-attempt"),
    # Admin token sources.
    pytest.param({"admin.token": "t"}, "admin.token_env", "only one", id="admin-token-and-env"),
    pytest.param({"admin.token_file": "/etc/narwhal/token"}, "admin.token_file", "only one",
                 id="admin-env-and-file"),
    # Top-level values.
    pytest.param({"model": DELETE}, "model", "required", id="missing-model"),
    pytest.param({"model": ""}, "model", "at least 1 character", id="empty-model"),
    pytest.param({"listen": "localhost"}, "listen", "host:port", id="listen-without-port"),
    pytest.param({"listen": ":8080"}, "listen", "host:port", id="listen-without-host"),
    pytest.param({"listen": "127.0.0.1:65536"}, "listen", "host:port", id="listen-bad-port"),
    pytest.param({"listen": 8080}, "listen", "valid string", id="listen-not-a-string"),
    # Enumerations and other URLs.
    pytest.param({"serving.policy": "retry"}, "serving.policy", "single_attempt",
                 id="unknown-policy"),
    pytest.param({"lease.backend": "consul"}, "lease.backend", "etcd", id="unknown-backend"),
    pytest.param({"lease.backend": "etcd", "lease.endpoints": ["ftp://127.0.0.1:2379"]},
                 "lease.endpoints[0]", "http://", id="etcd-endpoint-ftp"),
    pytest.param({"lease.endpoints": []}, "lease.endpoints", "at least one",
                 id="etcd-no-endpoints"),
    pytest.param({"standby.active_url": "127.0.0.1:8080"}, "standby.active_url", "http://",
                 id="standby-url-without-scheme"),
    # The document itself.
    pytest.param(Raw("- model: demo-model\n"), "(top level)", "mapping", id="top-level-list"),
    pytest.param(Raw("demo-model\n"), "(top level)", "mapping", id="top-level-scalar"),
    pytest.param(Raw(""), "(top level)", "mapping", id="empty-file"),
    pytest.param(Raw("model: [demo-model\n"), "(file)", "not valid YAML", id="invalid-yaml"),
    pytest.param(Raw("model: demo\n\tengines: []\n"), "(file)", "not valid YAML",
                 id="invalid-yaml-tab"),
    pytest.param(Raw("serving: {? [a, b] : 1}\n"), "serving", "not a list", id="list-as-key"),
    pytest.param(Raw("serving: {? {a: 1} : 1}\n"), "serving", "not a mapping",
                 id="mapping-as-key"),
    pytest.param(Raw("? [model, engines]\n: 1\n"), "(top level)", "not a list",
                 id="list-as-top-level-key"),
    pytest.param(Raw("serving:\n  max_connections: 1\n  max_connections: 2\n"),
                 "serving.max_connections", "duplicate key", id="duplicate-nested-key"),
    pytest.param(Raw("engines:\n- id: p0\n  id: p1\n"), "engines[0].id", "duplicate key",
                 id="duplicate-key-in-engine"),
    pytest.param(Raw("model: a\nlease: {backend: file, ttl_s: 10, ttl_s: 5}\n"), "lease.ttl_s",
                 "duplicate key", id="duplicate-key-in-flow-mapping"),
    # The lease file and the handoff document are separate files.
    pytest.param({"lease.path": "state/h.json", "handoff.path": "./state/h.json"}, "lease.path",
                 "handoff.path", id="lease-path-is-handoff-path"),
]  # fmt: skip


@pytest.mark.parametrize(("source", "key", "fragment"), BAD)
def test_bad_config_names_the_key(
    tmp_path: Path, source: dict[str, Any] | Raw, key: str, fragment: str
) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(write_config(tmp_path, source))
    problems = info.value.problems
    assert keys_of(problems) == [key], problems
    assert fragment in problems[0], problems
    assert str(info.value) == "\n".join(problems)


def test_the_base_of_the_table_is_valid(tmp_path: Path) -> None:
    cfg = load_config(write_config(tmp_path, {}))
    assert [e.id for e in cfg.engines] == ["p0", "p1", "d0", "d1"]


def test_unreadable_file_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "missing.yaml")
    assert keys_of(info.value.problems) == ["(file)"]
    assert "missing.yaml" in info.value.problems[0]


def test_every_problem_is_reported_at_once(tmp_path: Path) -> None:
    source = {
        "serving.max_connections": 0,
        "engine.probe_timeout_s": "5",
        "engines[1].url": "ftp://127.0.0.1:9002",
        "admin.bogus": 1,
    }
    with pytest.raises(ConfigError) as info:
        load_config(write_config(tmp_path, source))
    assert sorted(keys_of(info.value.problems)) == [
        "admin.bogus",
        "engine.probe_timeout_s",
        "engines[1].url",
        "serving.max_connections",
    ]


def test_parse_config_refuses_a_non_mapping() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(["model", "engines"])
    assert keys_of(info.value.problems) == ["(top level)"]


# Refusals beyond the table: YAML-level problems and normalised duplicates.


def test_yaml_problem_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(write_config(tmp_path, Raw("model: [demo-model\n")))
    assert all("\n" not in p for p in info.value.problems), info.value.problems


def test_non_utf8_file_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "narwhal.yaml"
    path.write_bytes(b"model: demo\xff\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert keys_of(info.value.problems) == ["(file)"]


def test_duplicate_yaml_key_is_refused(tmp_path: Path) -> None:
    text = yaml.safe_dump(BASE, sort_keys=False) + "model: other-model\n"
    with pytest.raises(ConfigError) as info:
        load_config(write_config(tmp_path, Raw(text)))
    assert keys_of(info.value.problems) == ["model"]


def test_a_nested_duplicate_deeper_down_names_the_full_path(tmp_path: Path) -> None:
    text = yaml.safe_dump(BASE, sort_keys=False).replace(
        "  role: decode\n", "  role: decode\n  role: prefill\n", 1
    )
    with pytest.raises(ConfigError) as info:
        load_config(write_config(tmp_path, Raw(text)))
    assert keys_of(info.value.problems) == ["engines[2].role"]


def test_the_same_key_in_different_mappings_is_not_a_duplicate(tmp_path: Path) -> None:
    # `path` in handoff and in lease, `id` in every engine: only repeats within one mapping count.
    source = {"handoff.path": "state/h.json", "lease.path": "state/l.json"}
    cfg = load_config(write_config(tmp_path, source))
    assert (cfg.handoff.path, cfg.lease.path) == ("state/h.json", "state/l.json")


def test_yaml_anchors_and_merges_are_not_duplicates(tmp_path: Path) -> None:
    text = yaml.safe_dump(BASE, sort_keys=False) + (
        "engine: &timeouts {health_timeout_s: 2.0}\n"
        "controller:\n  <<: {monitor_interval_s: 0.5}\n  monitor_interval_s: 0.25\n"
    )
    cfg = load_config(write_config(tmp_path, Raw(text)))
    assert (cfg.engine.health_timeout_s, cfg.controller.monitor_interval_s) == (2.0, 0.25)


@pytest.mark.parametrize("backend", ["none", "etcd"])
def test_lease_path_may_equal_handoff_path_without_a_lease_file(backend: str) -> None:
    edits = {"lease.backend": backend, "lease.path": "state/h.json", "handoff.path": "state/h.json"}
    assert parse_config(edited(BASE, edits)).lease.backend == backend


def test_infinite_duration_is_refused() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(edited(BASE, {"serving.request_timeout_s": float("inf")}))
    assert keys_of(info.value.problems) == ["serving.request_timeout_s"]


def test_engine_url_port_zero_is_refused() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(edited(BASE, {"engines[0].url": "http://127.0.0.1:0"}))
    assert keys_of(info.value.problems) == ["engines[0].url"]


def test_duplicate_url_differing_in_case_is_refused() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(edited(BASE, {"engines[3].url": "HTTP://127.0.0.1:9001"}))
    assert keys_of(info.value.problems) == ["engines[3].url"]


def test_bad_etcd_endpoint_names_its_index() -> None:
    endpoints = ["http://127.0.0.1:2379", "ftp://127.0.0.1:2379"]
    with pytest.raises(ConfigError) as info:
        parse_config(edited(BASE, {"lease.backend": "etcd", "lease.endpoints": endpoints}))
    assert keys_of(info.value.problems) == ["lease.endpoints[1]"]


# --- (c) lease timing derivation -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("ttl_s", "renew_interval_s"),
    [
        pytest.param(10, 2, id="defaults"),
        pytest.param(30, 5, id="long-ttl"),
        pytest.param(3, 1, id="short-ttl"),
        pytest.param(10, 7, id="renew-close-to-derived-deadline"),
        pytest.param(0.5, 0.1, id="sub-second"),
        pytest.param(10, 8, id="renew-above-three-quarters-ttl"),
        pytest.param(10, 9.5, id="renew-just-below-ttl"),
    ],
)  # fmt: skip
@pytest.mark.parametrize("backend", ["file", "none"])
def test_lease_renew_deadline_is_derived(
    ttl_s: float, renew_interval_s: float, backend: str
) -> None:
    lease = {"backend": backend, "ttl_s": ttl_s, "renew_interval_s": renew_interval_s}
    cfg = parse_config({**MINIMAL, "lease": lease})
    assert cfg.lease.renew_deadline_s is not None
    assert renew_interval_s < cfg.lease.effective_renew_deadline_s < ttl_s


def test_lease_renew_deadline_default_is_three_quarters_of_ttl() -> None:
    lease = {"backend": "file", "ttl_s": 20, "renew_interval_s": 4}
    assert parse_config({**MINIMAL, "lease": lease}).lease.effective_renew_deadline_s == 15


def test_lease_renew_deadline_given_explicitly_is_kept() -> None:
    lease = {"backend": "file", "ttl_s": 10, "renew_interval_s": 8, "renew_deadline_s": 9}
    assert parse_config({**MINIMAL, "lease": lease}).lease.effective_renew_deadline_s == 9


# --- (d) narwhal-serve --check-config ------------------------------------------------------------


def check_config(path: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "NARWHAL_ADMIN_TOKEN"}
    return subprocess.run(
        [sys.executable, "-m", "narwhal.cli.serve", "--check-config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=cwd,
        env=env,
        check=False,
    )


def test_check_config_accepts_the_example(tmp_path: Path) -> None:
    result = check_config(EXAMPLE, tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0].startswith("config OK"), result.stdout
    assert "Traceback" not in result.stderr
    assert list(tmp_path.iterdir()) == [], "--check-config must not create state files"


CLI_BAD = [
    pytest.param({"serving.max_connections": 0}, ["serving.max_connections"], id="zero"),
    pytest.param({"engines[1].url": "ftp://127.0.0.1:9002"}, ["engines[1].url"], id="bad-url"),
    pytest.param({"lease.renew_interval_s": 10}, ["lease.renew_interval_s"], id="lease-timing"),
    pytest.param({"colour": "blue"}, ["colour"], id="unknown-key"),
    pytest.param({"engines[2].role": "prefill", "engines[3].role": "prefill"}, ["engines"],
                 id="no-decode"),
    pytest.param({"admin.token": "t", "serving.first_token_timeout_s": 61},
                 ["serving.first_token_timeout_s", "admin.token_env"], id="two-problems"),
    pytest.param(Raw("model: [demo-model\n"), ["(file)"], id="invalid-yaml"),
    pytest.param(Raw("- a\n- b\n"), ["(top level)"], id="not-a-mapping"),
]  # fmt: skip


@pytest.mark.parametrize(("source", "keys"), CLI_BAD)
def test_check_config_refuses_with_status_2(
    tmp_path: Path, source: dict[str, Any] | Raw, keys: list[str]
) -> None:
    result = check_config(write_config(tmp_path, source), tmp_path)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    assert not result.stdout.startswith("config OK")
    prefixed = [line for line in result.stderr.splitlines() if line.startswith(CLI_PREFIX)]
    assert prefixed, result.stderr
    # Keep lines that name a key (a multi-line YAML message may add prefixed continuation lines).
    named = [line.removeprefix(CLI_PREFIX).split(": ", 1)[0] for line in prefixed]
    reported = [key for key in named if _KEY.fullmatch(key)]
    assert sorted(reported) == sorted(keys), result.stderr


def test_check_config_missing_file(tmp_path: Path) -> None:
    result = check_config(tmp_path / "nowhere.yaml", tmp_path)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    assert f"{CLI_PREFIX}(file): " in result.stderr
