"""Config reload (DESIGN §10): what a new, validated config changes in a running router.

Pure: `reload_changes(running, new)` splits the differences into the keys applied to new
requests (timeouts, policies, recovery, the default model, the engine set) and the keys that
need a restart (`listen`, `router_id`, the lease, the handoff, `serving.workers`, pool and
queue sizes, ...), which are reported and left as they are. The config it returns is what
the router runs from then on: the new values where they apply, the running ones elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from narwhal.config import Config

# Sections whose keys apply to new requests, except the ones listed: those size what was
# built at start (pools, queues, caches, the client server's limits).
_HOT = {
    "serving": frozenset(
        {
            "workers",
            "max_connections",
            "queue_limit",
            "max_body_bytes",
            "token_count_cache_size",
            "client_header_timeout_s",
            "client_body_timeout_s",
            "client_send_timeout_s",
            "max_client_connections",
        }
    ),
    "engine": frozenset({"control_connections", "ca_file"}),
    "recovery": frozenset(),
    # Flow control: the queue is resized, new limits and key policies apply to new requests
    # (docs/flow.md, Reload); its wait follows serving.request_timeout_s unless given.
    "flow": frozenset(),
}
_HOT_TOP = frozenset({"model", "engines", "logging", "auth", "tls"})


@dataclass(frozen=True)
class ReloadChanges:
    config: Config  # what the router runs from now on
    applied: tuple[str, ...]  # dotted keys that changed and apply to new requests
    restart_required: tuple[str, ...]  # dotted keys that changed and wait for a restart

    def to_json(self) -> dict[str, Any]:
        return {"applied": list(self.applied), "restart_required": list(self.restart_required)}


def reload_changes(running: Config, new: Config) -> ReloadChanges:
    applied: list[str] = []
    restart: list[str] = []
    update: dict[str, Any] = {}
    for key in Config.model_fields:
        old_value, new_value = getattr(running, key), getattr(new, key)
        if old_value == new_value:
            continue
        if key == "tls" and running.tls.enabled != new.tls.enabled:
            restart.append(key)  # HTTPS on or off: the listener is built at start
        elif key in _HOT_TOP:
            applied.append(key)
            update[key] = new_value
        elif key in _HOT and isinstance(old_value, BaseModel):
            update[key] = _section(key, old_value, new_value, _HOT[key], applied, restart)
        elif isinstance(old_value, BaseModel):
            restart.extend(_changed_fields(key, old_value, new_value))
        else:
            restart.append(key)
    return ReloadChanges(running.model_copy(update=update), tuple(applied), tuple(restart))


def _section(
    name: str,
    old: BaseModel,
    new: BaseModel,
    cold: frozenset[str],
    applied: list[str],
    restart: list[str],
) -> BaseModel:
    """The section as it runs from now on: new values, but the running ones for `cold` keys."""
    kept = {}
    for field in type(old).model_fields:
        if getattr(old, field) == getattr(new, field):
            continue
        if field in cold:
            restart.append(f"{name}.{field}")
            kept[field] = getattr(old, field)
        else:
            applied.append(f"{name}.{field}")
    return new.model_copy(update=kept)


def _changed_fields(name: str, old: BaseModel, new: BaseModel) -> list[str]:
    return [
        f"{name}.{field}"
        for field in type(old).model_fields
        if getattr(old, field) != getattr(new, field)
    ]
