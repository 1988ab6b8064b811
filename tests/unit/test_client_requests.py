"""Client request validation: bad bodies get the right OpenAI-style 4xx, good ones parse exactly."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from narwhal.dataplane.requests import BadRequest, ClientRequest, Endpoint, parse_request

MODEL = "demo-model"
USER = [{"role": "user", "content": "hello"}]


def _raw(body: Any) -> bytes:
    return body if isinstance(body, bytes) else orjson.dumps(body)


def _c(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "hello", **kw}


def _chat(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": USER, **kw}


# (id, endpoint, body, status, param)
BAD: list[tuple[str, Endpoint, Any, int, str | None]] = [
    # not JSON / not an object
    ("invalid-json", "completions", b'{"model": "demo-model",', 400, None),
    ("empty-body", "completions", b"", 400, None),
    ("not-utf8", "chat", b"\xff\xfe{}", 400, None),
    ("nan", "completions", b'{"prompt": "x", "temperature": NaN}', 400, None),
    ("array-body", "completions", [_c()], 400, None),
    ("string-body", "chat", "hello", 400, None),
    ("null-body", "chat", None, 400, None),
    ("number-body", "completions", 42, 400, None),
    # model
    ("model-not-string", "completions", _c(model=7), 400, "model"),
    ("model-null", "completions", _c(model=None), 400, "model"),
    # wrong types
    ("stream-string", "completions", _c(stream="true"), 400, "stream"),
    ("stream-int", "chat", _chat(stream=1), 400, "stream"),
    ("stream-options-list", "completions", _c(stream_options=["include_usage"]), 400, None),
    ("stream-options-bool", "chat", _chat(stream_options=True), 400, "stream_options"),
    ("max-tokens-string", "completions", _c(max_tokens="10"), 400, "max_tokens"),
    ("max-tokens-float", "completions", _c(max_tokens=1.5), 400, "max_tokens"),
    ("max-tokens-bool", "completions", _c(max_tokens=True), 400, "max_tokens"),
    (
        "max-tokens-huge",
        "completions",
        b'{"prompt": "x", "max_tokens": 1' + b"0" * 30 + b"}",
        400,
        "max_tokens",
    ),
    ("max-completion-tokens-string", "chat", _chat(max_completion_tokens="5"), 400, None),
    # max_tokens 0 or negative
    ("max-tokens-zero", "completions", _c(max_tokens=0), 400, "max_tokens"),
    ("max-tokens-negative", "completions", _c(max_tokens=-5), 400, "max_tokens"),
    ("max-tokens-zero-chat", "chat", _chat(max_tokens=0), 400, "max_tokens"),
    ("max-completion-tokens-zero", "chat", _chat(max_completion_tokens=0), 400, None),
    # n: served as parts, not streamed (dataplane/fanout.py)
    ("n-two-streamed", "completions", _c(n=2, stream=True), 400, "n"),
    ("n-two-streamed-chat", "chat", _chat(n=2, stream=True), 400, "n"),
    ("n-zero", "chat", _chat(n=0), 400, "n"),
    ("n-too-many", "completions", _c(n=1025), 400, "n"),
    ("batch-times-n-too-many", "completions", _c(prompt=["a", "b"], n=513), 400, "n"),
    ("n-string", "chat", _chat(n="1"), 400, "n"),
    # prompt
    ("prompt-missing", "completions", {"model": MODEL}, 400, "prompt"),
    ("prompt-null", "completions", _c(prompt=None), 400, "prompt"),
    ("prompt-number", "completions", _c(prompt=5), 400, "prompt"),
    ("prompt-object", "completions", _c(prompt={"text": "x"}), 400, "prompt"),
    ("prompt-empty-list", "completions", _c(prompt=[]), 400, "prompt"),
    ("prompt-mixed-list", "completions", _c(prompt=[1, "a"]), 400, "prompt"),
    ("prompt-bool-tokens", "completions", _c(prompt=[True, False]), 400, "prompt"),
    ("prompt-float-tokens", "completions", _c(prompt=[1.0, 2.0]), 400, "prompt"),
    ("batched-streamed", "completions", _c(prompt=["a", "b"], stream=True), 400, "prompt"),
    ("batched-mixed", "completions", _c(prompt=["a", [1]]), 400, "prompt"),
    ("batched-empty-token-list", "completions", _c(prompt=[[1, 2], []]), 400, "prompt"),
    ("chat-body-on-completions", "completions", _chat(), 400, "prompt"),
    # messages
    ("messages-missing", "chat", {"model": MODEL}, 400, "messages"),
    ("messages-null", "chat", _chat(messages=None), 400, "messages"),
    ("messages-empty", "chat", _chat(messages=[]), 400, "messages"),
    ("messages-object", "chat", _chat(messages={"role": "user"}), 400, "messages"),
    ("messages-string", "chat", _chat(messages="hi"), 400, "messages"),
    ("message-not-object", "chat", _chat(messages=["hi"]), 400, "messages[0]"),
    ("message-no-role", "chat", _chat(messages=[{"content": "hi"}]), 400, "messages[0]"),
    ("message-role-int", "chat", _chat(messages=[{"role": 1, "content": "x"}]), 400, "messages[0]"),
    (
        "second-message-content-int",
        "chat",
        _chat(messages=[*USER, {"role": "assistant", "content": 5}]),
        400,
        "messages[1].content",
    ),
    ("content-object", "chat", _chat(messages=[{"role": "user", "content": {}}]), 400, None),
    ("completions-body-on-chat", "chat", _c(), 400, "messages"),
]


@pytest.mark.parametrize(
    ("endpoint", "body", "status", "param"), [c[1:] for c in BAD], ids=[c[0] for c in BAD]
)
def test_bad_request(endpoint: Endpoint, body: Any, status: int, param: str | None) -> None:
    with pytest.raises(BadRequest) as info:
        parse_request(endpoint, _raw(body), MODEL)
    err = info.value
    assert err.status == status
    assert err.message
    if param is not None:
        assert err.param == param
    if status == 404:
        assert "does not exist" in err.message
    else:
        assert err.type == "invalid_request_error"


def _ok(endpoint: Endpoint, body: Any) -> ClientRequest:
    return parse_request(endpoint, _raw(body), MODEL)


# (id, endpoint, body, expected fields)
GOOD: list[tuple[str, Endpoint, dict[str, Any], dict[str, Any]]] = [
    (
        "completions-string",
        "completions",
        _c(),
        {"stream": False, "max_tokens": None, "prompt_text": "hello", "prompt_token_count": None},
    ),
    (
        "model-omitted",
        "completions",
        {"prompt": "x"},
        {"prompt_text": "x", "message_count": 0},
    ),
    (
        "token-ids-counted-exactly",
        "completions",
        _c(prompt=[101, 2023, 2003, 1037, 3231, 102]),
        {"prompt_text": None, "prompt_token_count": 6},
    ),
    (
        "single-token-id",
        "completions",
        _c(prompt=[0]),
        {"prompt_text": None, "prompt_token_count": 1},
    ),
    (
        "nested-token-ids-counted-exactly",
        "completions",
        _c(prompt=[[5, 6, 7]]),
        {"prompt_text": None, "prompt_token_count": 3},
    ),
    (
        "one-element-string-list",
        "completions",
        _c(prompt=["only one"]),
        {"prompt_text": "only one", "prompt_token_count": None},
    ),
    (
        "stream-with-usage",
        "completions",
        _c(stream=True, stream_options={"include_usage": True}, max_tokens=32),
        {"stream": True, "include_usage": True, "max_tokens": 32},
    ),
    (
        "stream-options-without-usage",
        "completions",
        _c(stream=True, stream_options={}),
        {"stream": True, "include_usage": False},
    ),
    (
        "stream-null-is-false",
        "completions",
        _c(stream=None, stream_options=None),
        {"stream": False, "include_usage": False},
    ),
    ("n-one", "completions", _c(n=1), {"max_tokens": None, "n": 1, "batch": None}),
    ("n-three", "chat", _chat(n=3), {"n": 3, "batch": None}),
    ("batched-strings", "completions", _c(prompt=["a", "b"]), {"batch": ("a", "b")}),
    (
        "batched-token-lists",
        "completions",
        _c(prompt=[[1, 2], [3]], n=2),
        {"batch": ([1, 2], [3]), "n": 2, "prompt_text": None, "prompt_token_count": None},
    ),
    (
        "chat-basic",
        "chat",
        _chat(),
        {
            "endpoint": "chat",
            "prompt_contains": ["hello"],
            "message_count": 1,
            "prompt_token_count": None,
        },
    ),
    (
        "chat-max-completion-tokens-wins",
        "chat",
        _chat(max_tokens=10, max_completion_tokens=20),
        {"max_tokens": 20},
    ),
    ("chat-max-tokens-only", "chat", _chat(max_tokens=10), {"max_tokens": 10}),
    (
        "chat-contents-joined",
        "chat",
        _chat(
            messages=[
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": None},
            ]
        ),
        {"prompt_contains": ["be brief", "hi"], "message_count": 3},
    ),
    (
        "chat-tools-are-in-the-prompt-text",
        "chat",
        _chat(tools=[{"type": "function", "function": {"name": "lookup_weather"}}]),
        {"prompt_contains": ["hello", "lookup_weather"], "message_count": 1},
    ),
    (
        "chat-tool-calls-are-in-the-prompt-text",
        "chat",
        _chat(
            messages=[
                *USER,
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "f", "arguments": '{"city": "Oslo"}'},
                        }
                    ],
                },
            ]
        ),
        {"prompt_contains": ["hello", "Oslo"], "message_count": 2},
    ),
    (
        "chat-content-parts",
        "chat",
        _chat(messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}]),
        {"prompt_contains": ["hi"], "message_count": 1},
    ),
]


@pytest.mark.parametrize(
    ("endpoint", "body", "expected"), [c[1:] for c in GOOD], ids=[c[0] for c in GOOD]
)
def test_good_request(endpoint: Endpoint, body: dict[str, Any], expected: dict[str, Any]) -> None:
    req = _ok(endpoint, body)
    expected = dict(expected)
    assert req.endpoint == expected.pop("endpoint", endpoint)
    # For chat, the prompt text is what bounds the rendered prompt: every content is in it.
    for fragment in expected.pop("prompt_contains", []):
        assert req.prompt_text is not None
        assert fragment in req.prompt_text
    for field, value in expected.items():
        assert getattr(req, field) == value, field
    assert req.body == body


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
@pytest.mark.parametrize(
    "kv",
    [{"remote_host": "evil.example", "remote_port": 1}, None, "x"],
    ids=["object", "null", "str"],
)
def test_client_kv_transfer_params_are_stripped(endpoint: Endpoint, kv: Any) -> None:
    body = _chat(kv_transfer_params=kv) if endpoint == "chat" else _c(kv_transfer_params=kv)
    req = _ok(endpoint, body)
    assert "kv_transfer_params" not in req.body
    rest = {k: v for k, v in body.items() if k != "kv_transfer_params"}
    assert req.body == rest


def test_other_fields_pass_through_untouched() -> None:
    body = _c(temperature=0.2, stop=["\n"], logprobs=3, seed=7, extra_body_thing={"a": [1]})
    assert _ok("completions", body).body == body


def test_token_id_count_is_exact_for_long_prompts() -> None:
    ids = list(range(5000))
    req = _ok("completions", _c(prompt=ids))
    assert req.prompt_token_count == 5000
    assert req.prompt_text is None


def test_bad_request_default_types() -> None:
    assert BadRequest(400, "m").type == "invalid_request_error"
    assert BadRequest(404, "m").type == "not_found_error"
    assert BadRequest(400, "m", type_="BadRequestError").type == "BadRequestError"
