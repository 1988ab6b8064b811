"""`EngineKeys` (dataplane/engine_calls.py): an engine's API key is read once per config (an
`api_key_env` is not read from the environment on every leg), and again when the engine's
config is replaced (a member changed, or a reload)."""

from __future__ import annotations

import pytest

from narwhal.config import EngineConfig, parse_config
from narwhal.dataplane.engine_calls import EngineKeys


def _engine(**extra: str) -> EngineConfig:
    engine = {"id": "p0", "url": "http://127.0.0.1:9001", "role": "both", **extra}
    return parse_config({"model": "m", "engines": [engine]}).engines[0]


def test_a_key_from_the_environment_is_read_once_per_config(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    keys = EngineKeys()
    engine = _engine(api_key_env="NARWHAL_TEST_ENGINE_KEY")
    monkeypatch.setenv("NARWHAL_TEST_ENGINE_KEY", "first")
    assert keys.of(engine) == "first"
    monkeypatch.setenv("NARWHAL_TEST_ENGINE_KEY", "second")
    assert keys.of(engine) == "first"
    replaced = _engine(api_key_env="NARWHAL_TEST_ENGINE_KEY")
    assert keys.of(replaced) == "second"


def test_no_key_is_remembered_as_none() -> None:
    keys = EngineKeys()
    engine = _engine()
    assert keys.of(engine) is None
    assert keys.of(_engine(api_key="secret")) == "secret"
