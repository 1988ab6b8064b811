"""Engines from a watched file (`discovery.file`), YAML or JSON, in one of two shapes:

- a list of engines in the config's `engines[]` shape (or a mapping with an `engines` list);
- Prometheus file_sd groups: `[{"targets": ["host:port", ...], "labels": {"role": ...,
  "kv_role": ..., "api": ..., "scheme": ...}}]`, each target one engine named `host-port`.

A file that cannot be read or does not validate is a `DiscoveryFailed` naming the problem:
nothing it manages changes until it is fixed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from narwhal.config import ConfigError, EngineConfig, parse_engine
from narwhal.discovery.dns import DiscoveryFailed

_LABELS = ("role", "kv_role", "api", "api_key_env", "slot_save_path")


@dataclass(frozen=True)
class Stamp:
    """What tells a changed file: inode, size and modification time."""

    inode: int
    size: int
    mtime_ns: int


def stamp(path: Path) -> Stamp:
    try:
        st = os.stat(path)
    except OSError as exc:
        raise DiscoveryFailed(f"{path}: {exc.strerror or exc}") from None
    return Stamp(st.st_ino, st.st_size, st.st_mtime_ns)


def read(path: Path) -> list[EngineConfig]:
    """Parse and validate the file's engines (blocking: run it in a thread)."""
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise DiscoveryFailed(f"{path}: cannot read: {exc}") from None
    except yaml.YAMLError as exc:
        raise DiscoveryFailed(f"{path}: not valid YAML or JSON: {exc}") from None
    return parse(data, str(path))


def parse(data: Any, where: str) -> list[EngineConfig]:
    if data is None:
        return []
    if isinstance(data, dict) and set(data) == {"engines"}:
        data = data["engines"]
    if not isinstance(data, list):
        raise DiscoveryFailed(f"{where}: must be a list of engines or of file_sd groups")
    engines: list[EngineConfig] = []
    for i, item in enumerate(data):
        if isinstance(item, dict) and "targets" in item:
            engines.extend(_group(item, f"{where}[{i}]"))
        else:
            engines.append(_one(item, f"{where}[{i}]"))
    ids = [e.id for e in engines]
    urls = [e.url for e in engines]
    for what, values in (("id", ids), ("url", urls)):
        repeated = sorted({v for v in values if values.count(v) > 1})
        if repeated:
            raise DiscoveryFailed(f"{where}: engine {what} listed twice: {repeated}")
    return engines


def _one(item: Any, where: str) -> EngineConfig:
    try:
        return parse_engine(item)
    except ConfigError as exc:
        raise DiscoveryFailed(f"{where}.{exc.problems[0]}") from None


def _group(group: dict[str, Any], where: str) -> list[EngineConfig]:
    targets, labels = group.get("targets"), group.get("labels") or {}
    if not isinstance(targets, list) or not isinstance(labels, dict):
        raise DiscoveryFailed(f"{where}: targets must be a list and labels a mapping")
    scheme = labels.get("scheme", "http")
    engines = []
    for j, target in enumerate(targets):
        if not isinstance(target, str) or not target:
            raise DiscoveryFailed(f"{where}.targets[{j}]: must be host:port")
        address = target.split("://", 1)[-1].rstrip("/")
        url = target if "://" in target else f"{scheme}://{address}"
        engine_id = address.replace("[", "").replace("]", "").replace(":", "-")
        fields = {k: labels[k] for k in _LABELS if k in labels}
        engines.append(_one({"id": engine_id, "url": url, **fields}, f"{where}.targets[{j}]"))
    return engines
