"""Typed, frozen configuration loaded from one YAML file.

Every error names the key (`serving.max_connections`, `engines[1].url`) and the problem;
callers turn a `ConfigError` into exit status 2. Durations carry their unit in the name.
"""

from __future__ import annotations

import ipaddress
import os
import re
import shlex
from collections.abc import Mapping, Sequence
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, Literal, Self, TypeVar
from urllib.parse import urlsplit

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    ValidationError,
    field_validator,
    model_validator,
)


class ConfigError(Exception):
    """A configuration problem; `problems` holds one `key: message` line each."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


class Role(StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"
    BOTH = "both"
    # An engine that serves `/v1/embeddings` (a pooling model): no PD, no KV transfer.
    EMBED = "embed"


GENERATIVE = frozenset({Role.PREFILL, Role.DECODE, Role.BOTH})


class KvRole(StrEnum):
    PRODUCER = "kv_producer"
    CONSUMER = "kv_consumer"
    BOTH = "kv_both"
    NONE = "kv_none"  # an embed engine's: it transfers no KV


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


def _check_url(value: str, key: str = "url") -> str:
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"{key} must start with http:// or https://, got {value!r}")
    if not parts.hostname:
        raise ValueError(f"{key} has no host: {value!r}")
    try:
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"{key} has a bad port: {value!r}") from exc
    if port == 0:
        raise ValueError(f"{key} has a bad port: {value!r}")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError(f"{key} must be a base URL without path or query: {value!r}")
    # Scheme and host are case-insensitive: normalise so duplicates are caught.
    return f"{parts.scheme}://{parts.netloc.lower()}"


_E = TypeVar("_E", bound=StrEnum)


def _enum_value(enum: type[_E], value: Any) -> _E:
    # Strict mode only accepts enum members from Python input; YAML gives strings.
    if isinstance(value, enum):
        return value
    if isinstance(value, str) and value in {m.value for m in enum}:
        return enum(value)
    raise ValueError(f"must be one of {', '.join(m.value for m in enum)}, got {value!r}")


# YAML gives strings, and strict mode takes only members: both fields convert first.
RoleField = Annotated[Role, BeforeValidator(lambda v: _enum_value(Role, v))]
KvRoleField = Annotated[
    KvRole | None, BeforeValidator(lambda v: None if v is None else _enum_value(KvRole, v))
]


def _kv_problem(role: Role, kv_role: KvRole | None) -> str | None:
    """Why `kv_role` (None: the role's default) cannot serve `role`, or None."""
    kv_role = kv_role or DEFAULT_KV_ROLE[role]
    if role in KV_ROLE_PERMITS[kv_role]:
        return None
    return f"kv_role: {kv_role.value} does not permit role {role.value}"


DEFAULT_KV_ROLE = {
    Role.PREFILL: KvRole.PRODUCER,
    Role.DECODE: KvRole.CONSUMER,
    Role.BOTH: KvRole.BOTH,
    Role.EMBED: KvRole.NONE,
}
KV_ROLE_PERMITS = {
    KvRole.PRODUCER: frozenset({Role.PREFILL}),
    KvRole.CONSUMER: frozenset({Role.DECODE}),
    KvRole.BOTH: frozenset({Role.PREFILL, Role.DECODE, Role.BOTH}),
    KvRole.NONE: frozenset({Role.EMBED}),
}


# tcp://HOST:PORT, HOST a name, an IPv4 address or a bracketed IPv6 one (as ZMQ writes it)
_ZMQ_TCP = r"^tcp://(\[[0-9A-Fa-f:.]+\]|[^\s:/\[\]]+):[0-9]{1,5}$"


class KvEventsConfig(_Section):
    """Where a vLLM engine publishes its KV events (`--kv-events-config`, DESIGN §11)."""

    endpoint: str = Field(pattern=_ZMQ_TCP)  # its ZMQ PUB socket, tcp://HOST:PORT
    replay_endpoint: str | None = Field(default=None, pattern=_ZMQ_TCP)  # its ROUTER socket
    topic: str = ""


class EngineConfig(_Section):
    id: str = Field(min_length=1, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")
    url: str
    role: RoleField
    kv_role: KvRoleField = None
    api: Literal["vllm", "llamacpp"] = "vllm"
    api_key: str | None = None
    api_key_env: str | None = None
    # llamacpp only: the engines' shared `--slot-save-path` as the router sees it, so saved
    # slot files can be removed after use (without it they are left for the operator).
    slot_save_path: str | None = Field(default=None, min_length=1)
    # The model the engine must serve (`GET /v1/models`); unset: the config's `model`.
    model: str | None = Field(default=None, min_length=1)
    # Cache-aware placement (DESIGN §11): the engine's KV-event publisher (none: Narwhal's
    # approximate index of what it placed there), and its prefix cache's size in tokens for
    # that approximate index (unset: placement's default).
    kv_events: KvEventsConfig | None = None
    kv_capacity_tokens: int | None = Field(default=None, ge=1)
    # Flow control (DESIGN §13): the engine counts as full once Narwhal has this many
    # requests in flight on it (unset: no limit of Narwhal's own).
    max_concurrency: PositiveInt | None = None

    @field_validator("url")
    @classmethod
    def _url(cls, value: str) -> str:
        return _check_url(value)

    def with_model(self, default: str) -> EngineConfig:
        """This engine with its model resolved (the router's default when it declares none)."""
        return self if self.model is not None else self.model_copy(update={"model": default})

    @model_validator(mode="after")
    def _kv(self) -> Self:
        if self.kv_role is None:
            object.__setattr__(self, "kv_role", DEFAULT_KV_ROLE[self.role])
        problem = _kv_problem(self.role, self.kv_role)
        if problem is not None:
            raise ValueError(problem)
        if self.api_key is not None and self.api_key_env is not None:
            raise ValueError("api_key: give api_key or api_key_env, not both")
        if self.slot_save_path is not None and self.api != "llamacpp":
            raise ValueError("slot_save_path: only engines with api llamacpp save slot files")
        return self

    @property
    def effective_kv_role(self) -> KvRole:
        assert self.kv_role is not None
        return self.kv_role

    def resolved_api_key(self) -> str | None:
        if self.api_key_env is not None:
            return os.environ.get(self.api_key_env)
        return self.api_key


def embed_mix_problem(engines: Sequence[EngineConfig]) -> str | None:
    """A model is served by embed engines or by generative ones, never both (a vLLM engine
    runs one task): the line naming the first engine that mixes them, else None."""
    kinds: dict[str | None, bool] = {}
    for i, eng in enumerate(engines):
        embed = eng.role is Role.EMBED
        if kinds.setdefault(eng.model, embed) is not embed:
            return (
                f"engines[{i}].role: model {eng.model!r} is served by "
                f"{'generative' if embed else 'embed'} engines already; a model's engines "
                "either all embed or all generate"
            )
    return None


class ServingConfig(_Section):
    max_connections: PositiveInt = 256
    policy: Literal["single_attempt", "bounded"] = "single_attempt"
    request_timeout_s: PositiveFloat = 60.0
    first_token_timeout_s: PositiveFloat = 10.0
    stream_idle_timeout_s: PositiveFloat = 5.0
    queue_limit: int = Field(default=256, ge=0)
    max_attempts: PositiveInt = 2
    # Client limits (DESIGN §12), on every path before any work: the body's size whatever
    # its framing; the whole request head's time; the time between two reads of a body; the
    # time an answer may wait for a client that takes none of it; the router's client
    # connections (all workers together).
    max_body_bytes: PositiveInt = 4 * 1024 * 1024
    client_header_timeout_s: PositiveFloat = 10.0
    client_body_timeout_s: PositiveFloat = 30.0
    client_send_timeout_s: PositiveFloat = 60.0
    max_client_connections: PositiveInt = 10000
    token_count_cache_size: int = Field(default=4096, ge=0)
    # Data-plane worker processes (DESIGN §9): an integer, or `auto` for the usable CPUs.
    workers: PositiveInt | Literal["auto"] = "auto"
    shutdown_grace_s: PositiveFloat = 30.0
    # Mid-stream migrations per request (DESIGN §1, "Migration"); unset: 2 under `bounded`,
    # 0 under `single_attempt`, which never migrates.
    migration_limit: NonNegativeInt | None = None

    @property
    def migrations(self) -> int:
        if self.migration_limit is not None:
            return self.migration_limit
        return 2 if self.policy == "bounded" else 0

    @field_validator("workers", mode="before")
    @classmethod
    def _workers(cls, value: Any) -> Any:
        """One message naming the key (the union's own errors would name its branches)."""
        if value == "auto" or (type(value) is int and value >= 1):
            return value
        raise ValueError("must be a positive integer or auto")

    @model_validator(mode="after")
    def _timings(self) -> Self:
        if self.first_token_timeout_s > self.request_timeout_s:
            raise ValueError("first_token_timeout_s: must not exceed request_timeout_s")
        if self.stream_idle_timeout_s > self.request_timeout_s:
            raise ValueError("stream_idle_timeout_s: must not exceed request_timeout_s")
        if self.policy == "single_attempt" and self.migration_limit:
            raise ValueError("migration_limit: must be 0 under policy single_attempt")
        return self


class EngineSection(_Section):
    control_connections: PositiveInt = 8
    health_timeout_s: PositiveFloat = 1.0
    probe_timeout_s: PositiveFloat = 5.0
    # The CA bundle that `https://` engines' certificates must chain to (unset: the system's).
    ca_file: str | None = Field(default=None, min_length=1)


class ControllerConfig(_Section):
    monitor_interval_s: PositiveFloat = 1.0
    monitor_failure_limit: PositiveInt = 3
    interval_s: PositiveFloat = 30.0
    drift_mode: Literal["off", "detect", "enforce"] = "enforce"
    drift_factor: float = Field(default=3.0, gt=1.0)
    drift_min_samples: PositiveInt = 20
    drift_intervals: PositiveInt = 2
    drift_hold_s: PositiveFloat = 300.0
    rebalance_roles: bool = False
    rebalance_min_eligible: PositiveInt = 2
    rebalance_max_in_flight: NonNegativeInt = 1
    # Re-read the config file when it changes, polled this often (None: only on SIGHUP or
    # POST /admin/reload). For a Kubernetes ConfigMap mount, which kubelet swaps in place.
    config_watch_interval_s: PositiveFloat | None = None


class RecoveryConfig(_Section):
    eject_after: PositiveInt = 3
    liveness_misses: PositiveInt = 3
    failure_quarantine_s: PositiveFloat | None = None


class HandoffConfig(_Section):
    path: str = "state/handoff.json"


class LeaseConfig(_Section):
    # `file` is the embedded default (DESIGN §5) once a lease section is given; a config with no
    # lease section at all runs a single router (`Config.lease` defaults to backend `none`).
    backend: Literal["none", "file", "etcd"] = "file"
    path: str = "state/lease.json"
    endpoints: tuple[str, ...] = ("http://127.0.0.1:2379",)
    key: str = "/narwhal/lease"
    ttl_s: PositiveFloat = 10.0
    renew_interval_s: PositiveFloat = 2.0
    renew_deadline_s: PositiveFloat | None = None
    # etcd only (ignored by `file`, like `endpoints` and `key`): the holder compacts etcd's
    # history this often, keeping at least this much of it; 0 leaves compaction to etcd.
    compaction_interval_s: NonNegativeFloat = 300.0

    @field_validator("endpoints", mode="before")
    @classmethod
    def _endpoints_list(cls, value: Any) -> Any:
        return tuple(value) if isinstance(value, list) else value

    @field_validator("endpoints")
    @classmethod
    def _endpoint_urls(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if not value:
            raise ValueError("at least one endpoint is required")
        out = []
        for i, v in enumerate(value):
            try:
                out.append(_check_url(v, "endpoint"))
            except ValueError as exc:
                raise ValueError(f"endpoints[{i}]: {exc}") from None
        return tuple(out)

    @model_validator(mode="after")
    def _timings(self) -> Self:
        if self.renew_interval_s >= self.ttl_s:
            raise ValueError("renew_interval_s: must be below ttl_s")
        if self.renew_deadline_s is None:
            # Fence with a margin before the local lease runs out: a quarter of the TTL, or
            # half the gap between renewals and expiry when renewals are close to the TTL.
            derived = max(self.ttl_s * 0.75, (self.renew_interval_s + self.ttl_s) / 2)
            object.__setattr__(self, "renew_deadline_s", derived)
        assert self.renew_deadline_s is not None
        if self.renew_deadline_s >= self.ttl_s:
            raise ValueError("renew_deadline_s: must be below ttl_s")
        if self.renew_deadline_s <= self.renew_interval_s:
            raise ValueError("renew_deadline_s: must exceed renew_interval_s")
        return self

    @property
    def effective_renew_deadline_s(self) -> float:
        assert self.renew_deadline_s is not None
        return self.renew_deadline_s


class StandbyConfig(_Section):
    active_url: str | None = None
    takeover_threshold: PositiveInt = 3

    @field_validator("active_url")
    @classmethod
    def _url(cls, value: str | None) -> str | None:
        return None if value is None else _check_url(value, "active_url")


class AdminConfig(_Section):
    token: str | None = None
    token_env: str | None = None
    token_file: str | None = None

    @model_validator(mode="after")
    def _one_source(self) -> Self:
        given = [k for k in ("token", "token_env", "token_file") if getattr(self, k) is not None]
        if len(given) > 1:
            raise ValueError(f"{given[1]}: give only one of token, token_env, token_file")
        return self

    def resolve_token(self) -> str | None:
        """The token, or None; a blank token is no token (it could never be presented)."""
        if self.token is not None:
            return self.token.strip() or None
        if self.token_env is not None:
            return os.environ.get(self.token_env) or None
        if self.token_file is not None:
            return Path(self.token_file).read_text().strip() or None
        return None


class TlsConfig(_Section):
    """HTTPS on `listen` (docs/edge.md): both files, or neither; re-read on reload."""

    cert_file: str | None = Field(default=None, min_length=1)
    key_file: str | None = Field(default=None, min_length=1)

    @model_validator(mode="after")
    def _pair(self) -> Self:
        if (self.cert_file is None) != (self.key_file is None):
            missing = "key_file" if self.key_file is None else "cert_file"
            raise ValueError(f"{missing}: give cert_file and key_file together")
        return self

    @property
    def enabled(self) -> bool:
        return self.cert_file is not None


PRIORITY_MIN, PRIORITY_MAX = -(2**31), 2**31 - 1  # vLLM's is an int; Narwhal's fits 32 bits
DEFAULT_POLICY = "default"
_KEY_LABEL = re.compile(r"^[0-9a-f]{12}$")


class KeyPolicy(_Section):
    """One client key's share under flow control (DESIGN §13, docs/flow.md): its requests'
    priority when the body gives none (lower first), its weight among the clients of a
    priority, and its rate limits (unset: none)."""

    priority: int = Field(default=0, ge=PRIORITY_MIN, le=PRIORITY_MAX)
    weight: PositiveFloat = 1.0
    requests_per_minute: PositiveInt | None = None
    tokens_per_minute: PositiveInt | None = None


class AuthConfig(_Section):
    """Client keys for `/v1/*` (docs/edge.md): either source, or both; and each key's flow
    policy, by the key's label (no secret in the config), with a `default` entry."""

    api_keys_env: str | None = Field(default=None, min_length=1)
    api_keys_file: str | None = Field(default=None, min_length=1)
    protect_metrics: bool = False
    key_policies: dict[str, KeyPolicy] = Field(default_factory=dict)

    @property
    def enabled(self) -> bool:
        return self.api_keys_env is not None or self.api_keys_file is not None

    def policy_for(self, label: str | None) -> KeyPolicy:
        """The policy of the key labelled `label` (None: keys are off): its own entry, else
        the `default` entry, else the defaults."""
        policies = self.key_policies
        own = policies.get(label) if label is not None else None
        return own or policies.get(DEFAULT_POLICY) or _NO_POLICY

    @field_validator("key_policies", mode="before")
    @classmethod
    def _label_keys(cls, value: Any) -> Any:
        """YAML reads an all-digit label as a number: its digits are the label."""
        if isinstance(value, Mapping):
            return {str(k) if type(k) is int else k: v for k, v in value.items()}
        return value

    @field_validator("key_policies")
    @classmethod
    def _labels(cls, value: dict[str, KeyPolicy]) -> dict[str, KeyPolicy]:
        for label in value:
            if label != DEFAULT_POLICY and not _KEY_LABEL.match(label):
                raise ValueError(
                    f"{label!r} is neither default nor a key label (the first 12 hex digits, "
                    "lower case, of the key's SHA-256; quote it in YAML)"
                )
        return value

    @model_validator(mode="after")
    def _sources(self) -> Self:
        if self.protect_metrics and not self.enabled:
            raise ValueError("protect_metrics: needs api_keys_env or api_keys_file")
        if not self.enabled:
            for label, policy in self.key_policies.items():
                if label != DEFAULT_POLICY:
                    raise ValueError(
                        f"key_policies: {label!r} names a client key, but there are none "
                        "(set api_keys_env or api_keys_file)"
                    )
                for limit in ("requests_per_minute", "tokens_per_minute"):
                    if getattr(policy, limit) is not None:
                        raise ValueError(
                            f"key_policies.default.{limit}: rate limits are per client key, "
                            "and there are none (set api_keys_env or api_keys_file)"
                        )
        return self


_NO_POLICY = KeyPolicy()


class FlowConfig(_Section):
    """Flow control (DESIGN §13, docs/flow.md): when every eligible engine of a role is full,
    requests wait in Narwhal's one queue, ordered by priority and fair shares."""

    # Unset: on under serving.policy bounded, off under single_attempt (`Config.flow_on`).
    enabled: bool | None = None
    queue_limit: NonNegativeInt = 1024  # waiting requests, the whole router
    # How long a request may wait to start; unset, 30 s or serving.request_timeout_s if less.
    max_wait_s: PositiveFloat = 30.0
    engine_waiting_max: NonNegativeInt = 8  # an engine's own queue beyond this: full
    engine_kv_usage_max: float = Field(default=0.95, gt=0.0, le=1.0)  # KV cache beyond: full
    # Slots of each role kept for requests of priority `headroom_priority` or lower (more
    # urgent): a less urgent request starts only while more than this many are free.
    headroom_slots: NonNegativeInt = 0
    headroom_priority: int = 0
    # Requests of this priority or lower (more urgent) that find a decode role full ask a
    # running stream of a less urgent priority to step aside and go on later from its last
    # token (docs/flow.md, "Preemption"). Unset: no preemption.
    preempt_priority: int | None = None


class TracingConfig(_Section):
    """OpenTelemetry spans (docs/edge.md), with the `tracing` extra installed."""

    # Where spans go: an OTLP/HTTP collector's base URL (`/v1/traces` is appended).
    otlp_endpoint: str | None = Field(default=None, min_length=1)
    service_name: str = Field(default="narwhal", min_length=1)
    export_interval_s: PositiveFloat = 5.0  # how often finished spans are sent

    @field_validator("otlp_endpoint")
    @classmethod
    def _endpoint(cls, value: str | None) -> str | None:
        return None if value is None else _check_url(value, "otlp_endpoint")


class LoggingConfig(_Section):
    # One JSON access-log line per client request: true, false, or `sample:N` (one in N).
    access: bool | str = False

    @field_validator("access")
    @classmethod
    def _access(cls, value: bool | str) -> bool | str:
        if isinstance(value, str):
            count = value.removeprefix("sample:")
            if not value.startswith("sample:") or not count.isdigit() or int(count) < 1:
                raise ValueError("must be true, false or sample:N with N >= 1")
        return value

    @property
    def access_every(self) -> int | None:
        """Log one request in this many (None: no access log)."""
        if isinstance(self.access, str):
            return int(self.access.removeprefix("sample:"))
        return 1 if self.access else None


class AttestationConfig(_Section):
    """How readmission attests an engine: `none`, `tls` or `command`."""

    kind: Literal["none", "tls", "command"] = "none"
    ca_file: str | None = None
    command: tuple[str, ...] | None = None
    timeout_s: PositiveFloat = 5.0

    @field_validator("command", mode="before")
    @classmethod
    def _command_list(cls, value: Any) -> Any:
        if isinstance(value, str):
            return tuple(shlex.split(value))
        return tuple(value) if isinstance(value, list) else value

    @model_validator(mode="after")
    def _needs(self) -> Self:
        if self.kind == "tls" and not self.ca_file:
            raise ValueError("ca_file: required when kind is tls")
        if self.kind == "command" and not self.command:
            raise ValueError("command: required when kind is command")
        return self


def _same_path(a: str, b: str) -> bool:
    """Whether two configured paths name the same file (relative to the working directory)."""
    return os.path.normpath(os.path.abspath(a)) == os.path.normpath(os.path.abspath(b))


class DnsSource(_Section):
    """One name to resolve (DESIGN §10): SRV records (each target a host name and a port,
    as a Kubernetes headless Service gives for a StatefulSet's pods), or, when the name has
    none, its A/AAAA records with `port`. Every engine found gets this role and kv_role.
    `port` is the engines' HTTP port: with SRV records, only the records on it are engines
    (a Service with several ports answers SRV for each); not set, a target must have one
    port (`_http._tcp.<service>` names a named port), and A/AAAA answers use 8000."""

    name: str = Field(min_length=1)
    port: int | None = Field(default=None, ge=1, le=65535)
    role: RoleField
    kv_role: KvRoleField = None
    api: Literal["vllm", "llamacpp"] = "vllm"
    scheme: Literal["http", "https"] = "http"
    api_key_env: str | None = None
    slot_save_path: str | None = Field(default=None, min_length=1)
    model: str | None = Field(default=None, min_length=1)

    @model_validator(mode="after")
    def _kv(self) -> Self:
        problem = _kv_problem(self.role, self.kv_role)
        if problem is not None:
            raise ValueError(problem)
        return self


class DiscoveryConfig(_Section):
    """Engines found at runtime (docs/discovery.md): `dns` names and a watched `file`."""

    interval_s: PositiveFloat = 10.0
    grace_s: NonNegativeFloat = 60.0
    timeout_s: PositiveFloat = 2.0
    nameservers: tuple[str, ...] = ()  # "host" or "host:port"; empty: the system's
    dns: tuple[DnsSource, ...] = ()
    file: str | None = Field(default=None, min_length=1)

    @field_validator("nameservers", "dns", mode="before")
    @classmethod
    def _list(cls, value: Any) -> Any:
        return tuple(value) if isinstance(value, list) else value

    @field_validator("nameservers")
    @classmethod
    def _nameservers(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for i, server in enumerate(value):
            host, _, port = server.rpartition(":") if server.count(":") == 1 else (server, "", "")
            if port and not (port.isdigit() and 0 < int(port) < 65536):
                raise ValueError(f"[{i}]: port must be 1-65535, got {server!r}")
            try:
                ipaddress.ip_address((host or server).strip("[]"))
            except ValueError:
                raise ValueError(f"[{i}]: not an IP address (and port): {server!r}") from None
        return value

    @property
    def enabled(self) -> bool:
        return bool(self.dns) or self.file is not None


def _tokenizer_path(value: str) -> str:
    """A `tokenizer.json`, or a directory holding one (and its `tokenizer_config.json`)."""
    path = Path(value)
    if path.is_dir():
        if not (path / "tokenizer.json").is_file():
            raise ValueError(f"{value!r} is a directory without tokenizer.json")
        return value
    if not path.is_file():
        raise ValueError(f"{value!r} does not exist")
    return value


TokenizerPath = Annotated[str, Field(min_length=1), AfterValidator(_tokenizer_path)]


class PlacementConfig(_Section):
    """Where a request runs (DESIGN §11, docs/placement.md)."""

    policy: Literal["least_loaded", "prefix"] = "prefix"  # DESIGN §1, §11
    # MODEL: a tokenizer.json, or a directory with tokenizer.json and tokenizer_config.json.
    tokenizers: dict[str, TokenizerPath] = Field(default_factory=dict)
    # For engines without `kv_events` (discovered ones): ports on the engine's host.
    kv_events_port: int | None = Field(default=None, ge=1, le=65535)
    kv_events_replay_port: int | None = Field(default=None, ge=1, le=65535)
    metrics_interval_s: PositiveFloat = 1.0
    metrics_stale_s: PositiveFloat = 5.0
    # The engines' KV block size (vLLM's `--block-size`), the unit of Narwhal's block keys.
    block_size_tokens: PositiveInt = 16

    @model_validator(mode="after")
    def _staleness(self) -> Self:
        if self.metrics_stale_s <= self.metrics_interval_s:
            raise ValueError("metrics_stale_s: must exceed metrics_interval_s")
        return self


def _parse_listen(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not (port.isascii() and port.isdigit()) or int(port) > 65535:
        raise ValueError(f"listen must be host:port, got {value!r}")
    return host.strip("[]"), int(port)


class Config(_Section):
    router_id: str | None = None
    listen: str = "127.0.0.1:8080"
    model: str = Field(min_length=1)
    engines: tuple[EngineConfig, ...] = ()
    discovery: DiscoveryConfig = DiscoveryConfig()
    serving: ServingConfig = ServingConfig()
    engine: EngineSection = EngineSection()
    controller: ControllerConfig = ControllerConfig()
    recovery: RecoveryConfig = RecoveryConfig()
    handoff: HandoffConfig = HandoffConfig()
    lease: LeaseConfig = LeaseConfig(backend="none")
    standby: StandbyConfig = StandbyConfig()
    admin: AdminConfig = AdminConfig()
    attestation: AttestationConfig = AttestationConfig()
    logging: LoggingConfig = LoggingConfig()
    auth: AuthConfig = AuthConfig()
    tls: TlsConfig = TlsConfig()
    tracing: TracingConfig = TracingConfig()
    placement: PlacementConfig = PlacementConfig()
    flow: FlowConfig = FlowConfig()

    @field_validator("engines", mode="before")
    @classmethod
    def _engines_list(cls, value: Any) -> Any:
        return tuple(value) if isinstance(value, list) else value

    @field_validator("listen")
    @classmethod
    def _listen(cls, value: str) -> str:
        _parse_listen(value)
        return value

    @model_validator(mode="after")
    def _fleet(self) -> Self:
        # Every engine serves a model: its own `model`, else the router's (the default).
        object.__setattr__(self, "engines", tuple(e.with_model(self.model) for e in self.engines))
        discovered = self.discovery.enabled
        if not self.engines and not discovered:
            raise ValueError("engines: at least one engine is required (or a discovery source)")
        seen_ids: set[str] = set()
        seen_urls: set[str] = set()
        for i, eng in enumerate(self.engines):
            if eng.id in seen_ids:
                raise ValueError(f"engines[{i}].id: duplicate engine id {eng.id!r}")
            if eng.url in seen_urls:
                raise ValueError(f"engines[{i}].url: duplicate engine url {eng.url!r}")
            seen_ids.add(eng.id)
            seen_urls.add(eng.url)
            if eng.api != self.fleet_api:
                raise ValueError(
                    f"engines[{i}].api: {eng.api} differs from engines[0].api "
                    f"{self.fleet_api}; a fleet speaks one engine API"
                )
        problem = embed_mix_problem(self.engines)
        if problem is not None:
            raise ValueError(problem)
        for i, source in enumerate(self.discovery.dns):
            if source.api != self.fleet_api:
                raise ValueError(
                    f"discovery.dns[{i}].api: {source.api} differs from the fleet's "
                    f"{self.fleet_api}; a fleet speaks one engine API"
                )
        if self.lease.backend == "file" and _same_path(self.lease.path, self.handoff.path):
            raise ValueError(
                f"lease.path: the lease file must differ from handoff.path ({self.lease.path!r})"
            )
        workers = self.serving.workers
        if workers != "auto" and workers > 1:
            if self.fleet_api == "llamacpp":
                raise ValueError(
                    "serving.workers: must be 1 or auto with llamacpp engines (their slots "
                    "are assigned by one process)"
                )
            if workers > self.serving.max_connections:
                raise ValueError("serving.workers: exceeds serving.max_connections")
        self._flow()
        roles = {e.role for e in self.engines} | {d.role for d in self.discovery.dns}
        roles &= GENERATIVE  # a router of embed engines alone serves embeddings alone
        # A discovery file may bring any role: /ready judges the fleet once it is read.
        if (
            self.discovery.file is None
            and roles
            and Role.BOTH not in roles
            and roles != {Role.PREFILL, Role.DECODE}
        ):
            missing = ({Role.PREFILL, Role.DECODE} - roles).pop()
            raise ValueError(f"engines: no engine has role {missing.value}")
        return self

    def _flow(self) -> None:
        """No wait past the request's own timeout (DESIGN §13): a `flow.max_wait_s` given
        above it is refused, the default is lowered to it."""
        flow, timeout_s = self.flow, self.serving.request_timeout_s
        if flow.max_wait_s <= timeout_s:
            return
        if "max_wait_s" in flow.model_fields_set:
            raise ValueError(
                f"flow.max_wait_s: {flow.max_wait_s:g} exceeds serving.request_timeout_s "
                f"({timeout_s:g}); a request cannot wait past its own timeout"
            )
        # A copy: the section may be the shared default instance.
        object.__setattr__(self, "flow", flow.model_copy(update={"max_wait_s": timeout_s}))

    @property
    def flow_on(self) -> bool:
        """Whether flow control runs: `flow.enabled`, else on under `bounded` (DESIGN §13)."""
        if self.flow.enabled is not None:
            return self.flow.enabled
        return self.serving.policy == "bounded"

    @property
    def fleet_api(self) -> str:
        """The one engine API of the fleet: the engines', else the discovered ones'."""
        if self.engines:
            return self.engines[0].api
        return self.discovery.dns[0].api if self.discovery.dns else "vllm"

    @property
    def listen_host(self) -> str:
        return _parse_listen(self.listen)[0]

    @property
    def listen_port(self) -> int:
        return _parse_listen(self.listen)[1]

    @property
    def effective_router_id(self) -> str:
        return self.router_id or self.listen

    def resolved_workers(self, usable_cpus: int | None = None) -> int:
        """How many data-plane processes to run: `auto` is the usable CPUs (capped by
        max_connections), and 1 for llamacpp engines, whose slots one process assigns."""
        workers = self.serving.workers
        if workers != "auto":
            return workers
        if self.fleet_api == "llamacpp":
            return 1
        cpus = usable_cpus if usable_cpus is not None else len(os.sched_getaffinity(0))
        return max(1, min(cpus, self.serving.max_connections))


_SUBKEY = re.compile(r"^([a-z_]+(?:\[\d+\])?(?:\.[a-z_]+)*): (.*)$", re.S)


def _key_path(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out or "(top level)"


def _format_errors(exc: ValidationError) -> list[str]:
    problems = []
    for err in exc.errors(include_url=False):
        loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and p.startswith("function-")))
        msg = err["msg"].removeprefix("Value error, ")
        key = _key_path(loc)
        # Model-level validators name their own sub-key ("engines[1].id: ...") in the message.
        sub = _SUBKEY.match(msg)
        if err["type"] == "value_error" and sub:
            head = re.split(r"[.\[]", sub[1], maxsplit=1)[0]
            if loc and loc[-1] == head:  # a field validator naming an item of its own field
                loc = loc[:-1]
            key = (
                f"{_key_path(loc)}{'' if sub[1].startswith('[') else '.'}{sub[1]}"
                if loc
                else sub[1]
            )
            msg = sub[2]
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        elif err["type"] == "missing":
            msg = "required key is missing"
        problems.append(f"{key}: {msg}")
    return problems


def parse_config(data: Any) -> Config:
    """Validate already-parsed YAML data into a Config."""
    if not isinstance(data, Mapping):
        raise ConfigError(["(top level): the configuration must be a mapping of keys"])
    try:
        return Config.model_validate(dict(data))
    except ValidationError as exc:
        raise ConfigError(_format_errors(exc)) from None


def parse_engine(data: Any) -> EngineConfig:
    """Validate one engine (`POST /admin/engines`, discovery) as the config's `engines[]`."""
    if not isinstance(data, Mapping):
        raise ConfigError(["(top level): an engine must be a JSON object"])
    try:
        return EngineConfig.model_validate(dict(data))
    except ValidationError as exc:
        raise ConfigError(_format_errors(exc)) from None


def load_config(path: str | Path) -> Config:
    """Read and validate a YAML config file."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError([f"(file): cannot read {path}: not UTF-8 ({exc.reason})"]) from None
    except OSError as exc:
        raise ConfigError([f"(file): cannot read {path}: {exc.strerror or exc}"]) from None
    try:
        data = yaml.load(text, Loader=_StrictLoader)
    except _KeyProblem as exc:
        raise ConfigError([exc.problem]) from None
    except yaml.YAMLError as exc:
        raise ConfigError([f"(file): {path} is not valid YAML: {_yaml_problem(exc)}"]) from None
    return parse_config(data)


class _KeyProblem(yaml.YAMLError):
    """A mapping key the config cannot have (repeated, or not a plain value), as `key: problem`."""

    def __init__(self, problem: str) -> None:
        super().__init__(problem)
        self.problem = problem


_MERGE_TAG = "tag:yaml.org,2002:merge"


class _StrictLoader(yaml.SafeLoader):
    """A SafeLoader that refuses duplicate and non-scalar keys instead of keeping the last one
    or crashing; problems name the full key path (`serving.max_connections`)."""

    def construct_document(self, node: yaml.Node) -> Any:
        self._check_keys(node, "", set())
        return super().construct_document(node)

    def _check_keys(self, node: yaml.Node, path: str, visited: set[int]) -> None:
        # Checked on the node graph before construction: nested mappings are built lazily, so
        # construct_mapping cannot know its parent's path. Aliases may repeat (or cycle).
        if id(node) in visited:
            return
        visited.add(id(node))
        if isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                self._check_keys(item, f"{path}[{i}]", visited)
        elif isinstance(node, yaml.MappingNode):
            seen: set[Any] = set()
            for key_node, value_node in node.value:
                if key_node.tag == _MERGE_TAG:
                    self._check_keys(value_node, path, visited)
                    continue
                if not isinstance(key_node, yaml.ScalarNode):
                    kind = "list" if isinstance(key_node, yaml.SequenceNode) else "mapping"
                    raise _KeyProblem(
                        f"{path or '(top level)'}: a key must be a plain value, not a {kind}"
                    )
                key = self.construct_object(key_node)
                key_path = f"{path}.{key}" if path else str(key)
                if key in seen:
                    raise _KeyProblem(f"{key_path}: duplicate key")
                seen.add(key)
                self._check_keys(value_node, key_path, visited)


def _yaml_problem(exc: yaml.YAMLError) -> str:
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    if mark is not None:
        return f"line {mark.line + 1}, column {mark.column + 1}: {problem}"
    return problem
