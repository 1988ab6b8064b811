"""Flow control's config (DESIGN §13): defaults, the cross-checks, and errors naming the key."""

from __future__ import annotations

from typing import Any

import pytest

from narwhal.config import ConfigError, KeyPolicy, parse_config

BASE: dict[str, Any] = {
    "model": "m",
    "engines": [
        {"id": "p0", "url": "http://127.0.0.1:9001", "role": "prefill", "max_concurrency": 4},
        {"id": "d0", "url": "http://127.0.0.1:9101", "role": "decode"},
    ],
}
KEYS = {"api_keys_env": "NARWHAL_TEST_KEYS"}


def config(**sections: Any) -> Any:
    return parse_config({**BASE, **sections})


def test_defaults() -> None:
    cfg = config()
    flow = cfg.flow
    assert (flow.queue_limit, flow.max_wait_s) == (1024, 30.0)
    assert (flow.engine_waiting_max, flow.engine_kv_usage_max) == (8, 0.95)
    assert [e.max_concurrency for e in cfg.engines] == [4, None]
    assert cfg.flow_on is False  # single_attempt
    assert config(serving={"policy": "bounded"}).flow_on is True
    assert config(serving={"policy": "bounded"}, flow={"enabled": False}).flow_on is False
    assert cfg.auth.key_policies == {} and cfg.auth.policy_for(None) == KeyPolicy()


def test_the_default_wait_never_passes_the_request_timeout() -> None:
    short = config(serving={"request_timeout_s": 10, "first_token_timeout_s": 5})
    assert short.flow.max_wait_s == 10
    again = parse_config(short.model_dump(mode="json"))  # as a worker receives it
    assert again.flow == short.flow
    assert config().flow.max_wait_s == 30  # the shared default section is left alone


def test_key_policies_by_label_with_a_default() -> None:
    policies = {
        "default": {"priority": 2, "weight": 1},
        "0123456789ab": {"priority": 0, "weight": 3, "requests_per_minute": 60},
        123456789012: {"tokens_per_minute": 1000},  # YAML reads an all-digit label as a number
    }
    auth = config(auth={**KEYS, "key_policies": policies}).auth
    assert auth.policy_for("0123456789ab") == KeyPolicy(weight=3, requests_per_minute=60)
    assert auth.policy_for("123456789012").tokens_per_minute == 1000
    assert auth.policy_for("ffffffffffff") == KeyPolicy(priority=2)
    assert auth.policy_for(None) == KeyPolicy(priority=2)


@pytest.mark.parametrize(
    ("sections", "problem"),
    [
        (
            {"flow": {"max_wait_s": 90}},
            "flow.max_wait_s: 90 exceeds serving.request_timeout_s (60); a request cannot "
            "wait past its own timeout",
        ),
        ({"flow": {"max_wait_s": 0}}, "flow.max_wait_s: Input should be greater than 0"),
        ({"flow": {"queue_limit": -1}}, "flow.queue_limit: Input should be greater than or"),
        ({"flow": {"engine_kv_usage_max": 1.2}}, "flow.engine_kv_usage_max: Input should be"),
        ({"flow": {"engine_waiting_max": "8"}}, "flow.engine_waiting_max: Input should be a"),
        ({"flow": {"enabled": "yes"}}, "flow.enabled: Input should be a valid boolean"),
        ({"flow": {"queue": 5}}, "flow.queue: unknown key"),
        (
            {"engines": [{**BASE["engines"][0], "max_concurrency": 0}, BASE["engines"][1]]},
            "engines[0].max_concurrency: Input should be greater than 0",
        ),
        (
            {"auth": {**KEYS, "key_policies": {"default": {"priority": 1.5}}}},
            "auth.key_policies.default.priority: Input should be a valid integer",
        ),
        (
            {"auth": {**KEYS, "key_policies": {"default": {"priority": True}}}},
            "auth.key_policies.default.priority: Input should be a valid integer",
        ),
        (
            {"auth": {**KEYS, "key_policies": {"default": {"weight": 0}}}},
            "auth.key_policies.default.weight: Input should be greater than 0",
        ),
        (
            {"auth": {**KEYS, "key_policies": {"0123456789ab": {"burst": 1}}}},
            "auth.key_policies.0123456789ab.burst: unknown key",
        ),
        (
            {"auth": {**KEYS, "key_policies": {"ABCDEF012345": {}}}},
            "auth.key_policies: 'ABCDEF012345' is neither default nor a key label",
        ),
        (
            {"auth": {"key_policies": {"0123456789ab": {}}}},
            "auth.key_policies: '0123456789ab' names a client key, but there are none",
        ),
        (
            {"auth": {"key_policies": {"default": {"requests_per_minute": 5}}}},
            "auth.key_policies.default.requests_per_minute: rate limits are per client key",
        ),
    ],
)
def test_refused_naming_the_key(sections: dict[str, Any], problem: str) -> None:
    with pytest.raises(ConfigError) as info:
        config(**sections)
    assert len(info.value.problems) == 1
    assert info.value.problems[0].startswith(problem), info.value.problems


def test_without_client_keys_default_sets_priority_and_weight() -> None:
    auth = config(auth={"key_policies": {"default": {"priority": 1, "weight": 2}}}).auth
    assert auth.policy_for(None) == KeyPolicy(priority=1, weight=2)
