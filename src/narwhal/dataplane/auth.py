"""Client authentication on `/v1/*` (issue 20 §1): `Authorization: Bearer <key>` against the
keys of `auth.api_keys_env` and `auth.api_keys_file`.

Keys are kept only as SHA-256 digests, and a presented key's digest is compared with every
one of them in constant time, so neither a match's position nor a near miss shows in the
time taken. Keys are never logged; a request is counted under a short label, the first 12
hex digits of its key's digest, which does not give the key back.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path

from narwhal.config import AuthConfig

LABEL_DIGITS = 12


class KeysUnreadable(Exception):
    """`auth.api_keys_file` could not be read."""


def parse_keys(text: str) -> list[str]:
    """Keys separated by commas or newlines; blank entries and `#` comments are skipped."""
    keys: list[str] = []
    for line in text.splitlines():
        if line.strip().startswith("#"):
            continue
        keys.extend(k.strip() for k in line.split(",") if k.strip())
    return keys


def load_keys(config: AuthConfig) -> list[str]:
    """The keys of the environment variable and the file (re-read on every call)."""
    keys: list[str] = []
    if config.api_keys_env is not None:
        keys += parse_keys(os.environ.get(config.api_keys_env, ""))
    if config.api_keys_file is not None:
        try:
            keys += parse_keys(Path(config.api_keys_file).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as exc:
            raise KeysUnreadable(f"auth.api_keys_file: cannot read: {exc}") from None
    return keys


class ApiKeys:
    def __init__(self, keys: list[str]) -> None:
        self._digests = [hashlib.sha256(k.encode()).digest() for k in keys]

    def __len__(self) -> int:
        return len(self._digests)

    def label(self, authorization: str | None) -> str | None:
        """The key's label when `authorization` is `Bearer <a known key>`, else None."""
        if authorization is None or authorization[:7].lower() != "bearer ":
            return None
        digest = hashlib.sha256(authorization[7:].strip().encode()).digest()
        matched = False
        for known in self._digests:  # every one, match or not: constant time
            matched |= hmac.compare_digest(digest, known)
        return digest.hex()[:LABEL_DIGITS] if matched else None


def key_problems(config: AuthConfig) -> list[str]:
    """Why the configured keys cannot serve (unreadable, or none at all), for start-up and
    reload: with auth on and no key, every request would be refused."""
    if not config.enabled:
        return []
    try:
        keys = load_keys(config)
    except KeysUnreadable as exc:
        return [str(exc)]
    if not keys:
        where = " and ".join(
            f"{k} {v!r}"
            for k, v in (
                ("api_keys_env", config.api_keys_env),
                ("api_keys_file", config.api_keys_file),
            )
            if v is not None
        )
        return [f"auth: no API key in {where}"]
    return []
