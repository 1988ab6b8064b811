"""What `narwhal-serve` refuses before it starts, in one function that `--config`,
`--check-config` and `--demo` all run: a config `--check-config` calls OK then starts, unless
the network says otherwise (a listen port in use, a listen host that does not resolve), which
only binding can tell. Each problem is one `key: message` line, like a validation error.

Unlike validation these checks read the host: files (TLS, CA bundles, API keys, the admin
token file), environment variables (`admin.token_env`, `auth.api_keys_env`) and the state
directories. Run `--check-config` as the router will run: same user, environment and working
directory."""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path

from narwhal.config import Config, ConfigError
from narwhal.dataplane.auth import key_problems
from narwhal.tls import engine_context, server_context


def startup_problems(config: Config, *, standby: bool = False) -> list[str]:
    """Every reason this config cannot start here (empty: it can, bar the network)."""
    problems = _admin_problems(config)
    problems += key_problems(config.auth)
    problems += _tls_problems(config)
    for key, path in state_paths(config).items():
        problem = _directory_problem(path)
        if problem is not None:
            problems.append(f"{key}: {problem}")
    if standby and config.lease.backend == "none":
        problems.append("lease.backend: --standby needs a shared lease (file or etcd)")
    return problems


def state_paths(config: Config) -> dict[str, str]:
    """The files whose directories the router writes in (and creates at start), by key."""
    paths = {"handoff.path": config.handoff.path}
    if config.lease.backend == "file":
        paths["lease.path"] = config.lease.path
    return paths


def _tls_problems(config: Config) -> list[str]:
    """The listener's certificate and key load and match; the engines' CA bundle loads."""
    problems = []
    try:
        server_context(config.tls)
    except ConfigError as exc:
        problems += exc.problems
    try:
        engine_context(config.engine.ca_file)
    except ConfigError as exc:
        problems += exc.problems
    return problems


def _admin_problems(config: Config) -> list[str]:
    try:
        token = config.admin.resolve_token()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        return [f"admin.token_file: cannot read: {reason}"]
    if token is None and not _is_loopback(config.listen_host):
        return [
            "admin: the admin API needs a token to listen on a non-loopback address "
            f"({config.listen_host})"
        ]
    return []


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _directory_problem(path: str) -> str | None:
    """Why the router could not write `path` (creating its directory first), without creating
    anything: the nearest existing ancestor must be a directory it may write in."""
    target = Path(os.path.abspath(path))
    directory = target.parent
    try:
        if target.is_dir():
            return f"{path!r} is a directory"
        existing = directory
        while not existing.exists():
            existing = existing.parent
    except OSError as exc:  # a parent it may not search
        return f"cannot check directory {str(directory)!r}: {exc.strerror or exc}"
    if existing != directory:
        verb = f"cannot create directory {str(directory)!r}: {str(existing)!r}"
    else:
        verb = f"directory {str(directory)!r}"
    if not existing.is_dir():
        return f"{verb} is not a directory"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{verb} is not writable"
    return None
