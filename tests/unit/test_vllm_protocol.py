"""vLLM's NixlConnector PD wire contract (DESIGN §1): prefill body, handoff, decode body."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from narwhal.engine.vllm import (
    PREFILL_KV_PARAMS,
    FinishedInPrefill,
    Handoff,
    Unreadable,
    decode_body,
    extract_handoff,
    prefill_body,
    strip_client_kv_params,
)

EXPECTED_PREFILL_KV = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}

STRIPPED = ("stream_options", "min_tokens", "min_completion_tokens")


def _handoff_params(**overrides: Any) -> dict[str, Any]:
    params: dict[str, Any] = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "engine-7f3a",
        "remote_block_ids": [0, 1, 2, 17],
        "remote_request_id": "cmpl-req-1-0",
        "remote_host": "10.0.0.5",
        "remote_port": 5600,
        "tp_size": 1,
    }
    params.update(overrides)
    return params


def _response(params: Any = ..., finish_reason: str | None = "length") -> dict[str, Any]:
    """A prefill response; `params=...` leaves kv_transfer_params out entirely."""
    resp: dict[str, Any] = {
        "id": "cmpl-1",
        "object": "text_completion",
        "model": "m",
        "choices": [{"index": 0, "text": "x", "finish_reason": finish_reason}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
    }
    if params is not ...:
        resp["kv_transfer_params"] = params
    return resp


def _without(key: str) -> dict[str, Any]:
    params = _handoff_params()
    del params[key]
    return params


# --------------------------------------------------------------------------- prefill body

PREFILL_CASES: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    (
        "completions-minimal",
        {"model": "m", "prompt": "hi"},
        {"model": "m", "prompt": "hi", "max_tokens": 1, "stream": False},
    ),
    (
        "completions-stream-with-options",
        {
            "model": "m",
            "prompt": "hi",
            "max_tokens": 64,
            "stream": True,
            "stream_options": {"include_usage": True},
            "temperature": 0.5,
        },
        {"model": "m", "prompt": "hi", "max_tokens": 1, "stream": False, "temperature": 0.5},
    ),
    (
        "min-tokens-removed",
        {"model": "m", "prompt": "hi", "min_tokens": 10, "max_tokens": 20},
        {"model": "m", "prompt": "hi", "max_tokens": 1, "stream": False},
    ),
    (
        "chat-max-completion-tokens-set-to-one",
        {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "max_completion_tokens": 300,
            "min_completion_tokens": 5,
            "stream": True,
        },
        {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 1,
            "max_completion_tokens": 1,
            "stream": False,
        },
    ),
    (
        "max-completion-tokens-not-invented",
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 9},
        {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 1,
            "stream": False,
        },
    ),
    (
        "client-kv-params-replaced",
        {
            "model": "m",
            "prompt": "hi",
            "kv_transfer_params": {"do_remote_prefill": True, "remote_host": "evil.example"},
        },
        {"model": "m", "prompt": "hi", "max_tokens": 1, "stream": False},
    ),
    (
        "stream-false-stays-false",
        {"model": "m", "prompt": [1, 2, 3], "stream": False, "stop": ["\n"]},
        {"model": "m", "prompt": [1, 2, 3], "max_tokens": 1, "stream": False, "stop": ["\n"]},
    ),
]


@pytest.mark.parametrize(
    ("client", "expected"), [c[1:] for c in PREFILL_CASES], ids=[c[0] for c in PREFILL_CASES]
)
def test_prefill_body(client: dict[str, Any], expected: dict[str, Any]) -> None:
    before = copy.deepcopy(client)
    body = prefill_body(client)
    assert body == {**expected, "kv_transfer_params": EXPECTED_PREFILL_KV}
    assert client == before


def test_prefill_kv_params_constant_matches_contract() -> None:
    assert PREFILL_KV_PARAMS == EXPECTED_PREFILL_KV


def test_prefill_kv_params_are_a_fresh_copy_each_time() -> None:
    first = prefill_body({"prompt": "a"})
    first["kv_transfer_params"]["remote_host"] = "mutated"
    second = prefill_body({"prompt": "a"})
    assert second["kv_transfer_params"] == EXPECTED_PREFILL_KV
    assert PREFILL_KV_PARAMS == EXPECTED_PREFILL_KV


_json_leaf = st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.text(max_size=8)
_json = st.recursive(
    _json_leaf,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)
_interesting_keys = st.sampled_from(
    [
        "model",
        "prompt",
        "messages",
        "max_tokens",
        "max_completion_tokens",
        "min_tokens",
        "min_completion_tokens",
        "stream",
        "stream_options",
        "kv_transfer_params",
        "temperature",
        "n",
    ]
)
_bodies = st.dictionaries(_interesting_keys | st.text(max_size=10), _json, max_size=8)


@settings(max_examples=60, deadline=None)
@given(_bodies)
def test_prefill_body_property(client: dict[str, Any]) -> None:
    before = copy.deepcopy(client)
    body = prefill_body(client)
    assert client == before, "prefill_body mutated its input"
    assert body is not client
    assert body["max_tokens"] == 1
    assert body["stream"] is False
    assert body["kv_transfer_params"] == EXPECTED_PREFILL_KV
    for key in STRIPPED:
        assert key not in body
    if "max_completion_tokens" in client:
        assert body["max_completion_tokens"] == 1
    else:
        assert "max_completion_tokens" not in body
    untouched = set(client) - {*STRIPPED, "max_tokens", "max_completion_tokens", "stream"}
    untouched.discard("kv_transfer_params")
    for key in untouched:
        assert body[key] == client[key]
    assert set(body) == (set(client) - set(STRIPPED)) | {
        "max_tokens",
        "stream",
        "kv_transfer_params",
    }


# --------------------------------------------------------------------------- decode body


def test_decode_body_is_client_body_plus_handoff() -> None:
    client = {
        "model": "m",
        "prompt": "hello",
        "max_tokens": 50,
        "stream": True,
        "stream_options": {"include_usage": True},
        "min_tokens": 3,
    }
    before = copy.deepcopy(client)
    params = _handoff_params()
    body = decode_body(client, Handoff(params))
    assert body == {**before, "kv_transfer_params": _handoff_params()}
    assert client == before


def test_decode_body_replaces_client_kv_params() -> None:
    client = {"model": "m", "prompt": "x", "kv_transfer_params": {"remote_host": "evil.example"}}
    body = decode_body(client, Handoff(_handoff_params()))
    assert body["kv_transfer_params"] == _handoff_params()
    assert client["kv_transfer_params"] == {"remote_host": "evil.example"}


@pytest.mark.parametrize(
    ("client", "expected"),
    [
        ({"prompt": "x"}, {"prompt": "x"}),
        ({"prompt": "x", "kv_transfer_params": {"a": 1}}, {"prompt": "x"}),
        ({"kv_transfer_params": None}, {}),
    ],
    ids=["absent", "object", "null"],
)
def test_strip_client_kv_params(client: dict[str, Any], expected: dict[str, Any]) -> None:
    before = copy.deepcopy(client)
    assert strip_client_kv_params(client) == expected
    assert client == before


# --------------------------------------------------------------------------- handoff

READABLE: list[tuple[str, dict[str, Any]]] = [
    ("full", _response(_handoff_params())),
    ("no-tp-size", _response(_without("tp_size"))),
    ("empty-block-list", _response(_handoff_params(remote_block_ids=[]))),
    ("stop-with-handoff", _response(_handoff_params(), finish_reason="stop")),
    ("extra-fields-kept", _response(_handoff_params(something_new={"x": 1}))),
    ("no-choices", {"kv_transfer_params": _handoff_params()}),
    (
        "minimal",
        _response(
            {
                "do_remote_prefill": True,
                "remote_engine_id": "engine-7f3a",
                "remote_block_ids": [3, 4],
                "remote_request_id": "cmpl-1",
                "remote_host": "10.0.0.5",
                "remote_port": 5600,
            }
        ),
    ),
    # Connectors for hybrid models send one block list per KV cache group.
    ("block-ids-nested", _response(_handoff_params(remote_block_ids=[[1, 2], [7, 8, 9]]))),
    ("block-ids-nested-one-group", _response(_handoff_params(remote_block_ids=[[1, 2]]))),
    ("block-ids-nested-empty-group", _response(_handoff_params(remote_block_ids=[[], [5]]))),
    ("tp-size-4", _response(_handoff_params(tp_size=4))),
]


@pytest.mark.parametrize("response", [c[1] for c in READABLE], ids=[c[0] for c in READABLE])
def test_readable_handoff(response: dict[str, Any]) -> None:
    before = copy.deepcopy(response)
    result = extract_handoff(response)
    assert isinstance(result, Handoff)
    assert result.params == before["kv_transfer_params"]
    assert response == before


def test_handoff_params_are_a_copy() -> None:
    response = _response(_handoff_params())
    result = extract_handoff(response)
    assert isinstance(result, Handoff)
    response["kv_transfer_params"]["remote_host"] = "changed-later"
    assert result.params["remote_host"] == "10.0.0.5"


UNREADABLE: list[tuple[str, Any]] = [
    ("response-not-object-list", [1, 2]),
    ("response-not-object-str", "oops"),
    ("response-null", None),
    ("params-missing", _response()),
    ("params-missing-no-choices", {"id": "x"}),
    ("params-null-length", _response(None, finish_reason="length")),
    ("params-null-no-finish", _response(None, finish_reason=None)),
    ("params-list", _response([1, 2])),
    ("params-string", _response("handoff")),
    ("params-empty-object", _response({})),
    ("do-remote-prefill-false", _response(_handoff_params(do_remote_prefill=False))),
    ("do-remote-prefill-missing", _response(_without("do_remote_prefill"))),
    ("engine-id-missing", _response(_without("remote_engine_id"))),
    ("engine-id-null", _response(_handoff_params(remote_engine_id=None))),
    ("engine-id-int", _response(_handoff_params(remote_engine_id=7))),
    ("block-ids-missing", _response(_without("remote_block_ids"))),
    ("block-ids-null", _response(_handoff_params(remote_block_ids=None))),
    ("block-ids-string", _response(_handoff_params(remote_block_ids="1,2"))),
    ("block-ids-dict", _response(_handoff_params(remote_block_ids={"0": 1}))),
    ("block-ids-strings", _response(_handoff_params(remote_block_ids=["1", "2"]))),
    ("block-ids-floats", _response(_handoff_params(remote_block_ids=[1.0, 2.0]))),
    ("block-ids-bools", _response(_handoff_params(remote_block_ids=[True, False]))),
    ("block-ids-nested-strings", _response(_handoff_params(remote_block_ids=[["1"]]))),
    ("block-ids-nested-bools", _response(_handoff_params(remote_block_ids=[[True]]))),
    ("block-ids-nested-too-deep", _response(_handoff_params(remote_block_ids=[[[1]]]))),
    ("block-ids-mixed", _response(_handoff_params(remote_block_ids=[1, [2, 3]]))),
    ("block-ids-nested-null", _response(_handoff_params(remote_block_ids=[None]))),
    ("request-id-missing", _response(_without("remote_request_id"))),
    ("request-id-null", _response(_handoff_params(remote_request_id=None))),
    ("request-id-int", _response(_handoff_params(remote_request_id=5))),
    ("request-id-list", _response(_handoff_params(remote_request_id=["r"]))),
    ("tp-size-string", _response(_handoff_params(tp_size="1"))),
    ("tp-size-bool", _response(_handoff_params(tp_size=True))),
    ("tp-size-float", _response(_handoff_params(tp_size=1.0))),
    ("host-missing", _response(_without("remote_host"))),
    ("host-null", _response(_handoff_params(remote_host=None))),
    ("host-list", _response(_handoff_params(remote_host=["10.0.0.5"]))),
    ("port-missing", _response(_without("remote_port"))),
    ("port-string", _response(_handoff_params(remote_port="5600"))),
    ("port-float", _response(_handoff_params(remote_port=5600.0))),
    ("port-bool", _response(_handoff_params(remote_port=True))),
    ("port-zero", _response(_handoff_params(remote_port=0))),
    ("port-too-large", _response(_handoff_params(remote_port=65536))),
    ("port-negative", _response(_handoff_params(remote_port=-1))),
    # A stop without a handoff is complete, but a stop with a broken handoff is not.
    ("stop-with-broken-handoff", _response({"do_remote_prefill": True}, finish_reason="stop")),
    ("stop-with-handoff-list", _response([], finish_reason="stop")),
]


@pytest.mark.parametrize("response", [c[1] for c in UNREADABLE], ids=[c[0] for c in UNREADABLE])
def test_unreadable_handoff(response: Any) -> None:
    result = extract_handoff(response)
    assert isinstance(result, Unreadable)
    assert result.reason


FINISHED: list[tuple[str, dict[str, Any]]] = [
    ("stop-params-absent", _response(finish_reason="stop")),
    ("stop-params-null", _response(None, finish_reason="stop")),
    (
        "chat-stop-params-null",
        {
            "object": "chat.completion",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": ""},
                    "finish_reason": "stop",
                }
            ],
            "kv_transfer_params": None,
        },
    ),
]


@pytest.mark.parametrize("response", [c[1] for c in FINISHED], ids=[c[0] for c in FINISHED])
def test_finished_in_prefill(response: dict[str, Any]) -> None:
    assert isinstance(extract_handoff(response), FinishedInPrefill)


@pytest.mark.parametrize(
    "finish_reason",
    ["length", "abort", None, "STOP"],
    ids=["length", "abort", "none", "wrong-case"],
)
def test_no_handoff_without_stop_is_unreadable(finish_reason: str | None) -> None:
    assert isinstance(extract_handoff(_response(finish_reason=finish_reason)), Unreadable)


@pytest.mark.parametrize(
    "choices",
    [[], "stop", [None], ["stop"], None],
    ids=["empty", "string", "null-choice", "string-choice", "null"],
)
def test_odd_choices_without_handoff_are_unreadable(choices: Any) -> None:
    assert isinstance(extract_handoff({"choices": choices}), Unreadable)


_valid_params = st.fixed_dictionaries(
    {
        "do_remote_prefill": st.just(True),
        "remote_engine_id": st.text(max_size=20),
        "remote_block_ids": st.lists(st.integers(0, 2**31), max_size=20)
        | st.lists(st.lists(st.integers(0, 2**31), max_size=5), max_size=4),
        "remote_host": st.text(max_size=20),
        "remote_port": st.integers(1, 65535),
        "remote_request_id": st.text(max_size=20),
    },
    optional={
        "tp_size": st.integers(1, 8),
        "do_remote_decode": st.booleans(),
    },
)


@settings(max_examples=60, deadline=None)
@given(_valid_params, st.sampled_from(["length", "stop"]))
def test_any_well_typed_handoff_is_readable(params: dict[str, Any], finish: str) -> None:
    result = extract_handoff(_response(params, finish_reason=finish))
    assert result == Handoff(params)


@settings(max_examples=60, deadline=None)
@given(
    _valid_params,
    st.sampled_from(
        [
            "remote_engine_id",
            "remote_block_ids",
            "remote_request_id",
            "remote_host",
            "remote_port",
            "tp_size",
        ]
    ),
    _json_leaf | st.lists(st.text(max_size=3), min_size=1, max_size=2),
)
def test_any_mistyped_required_field_is_unreadable(
    params: dict[str, Any], field: str, value: Any
) -> None:
    expected_type = {
        "remote_engine_id": str,
        "remote_block_ids": list,
        "remote_request_id": str,
        "remote_host": str,
        "remote_port": int,
        "tp_size": int,
    }[field]
    well_typed = isinstance(value, expected_type) and not isinstance(value, bool)
    if field == "tp_size" and value is None:
        well_typed = True  # optional: null is the same as absent
    if field == "remote_port" and well_typed:
        well_typed = 0 < value < 65536
    if field == "remote_block_ids" and well_typed:
        well_typed = all(isinstance(b, int) and not isinstance(b, bool) for b in value) or all(
            isinstance(g, list) and all(isinstance(b, int) and not isinstance(b, bool) for b in g)
            for g in value
        )
    params = {**params, field: value}
    result = extract_handoff(_response(params))
    assert isinstance(result, Handoff) == well_typed
