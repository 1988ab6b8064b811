"""Migration's `Splice` (DESIGN §1): whole events only, ids hidden unless asked for, in-band
errors cut, continuation requests, a continuation leg rewritten to look like the first."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from narwhal.dataplane.migration import TEXT, TOKEN_IDS, Continuation, Splice, migratable
from narwhal.engine.adapter import Endpoint

DONE = b"data: [DONE]\n\n"
ERROR = {"error": {"message": "boom", "type": "InternalServerError", "code": 500}}
HEAD = {"id": "cmpl-1", "created": 100, "model": "m"}
CHAT_HEAD = {"id": "chatcmpl-1", "created": 100, "model": "m"}
MESSAGES = [{"role": "user", "content": "hi"}]


def _sse(*events: dict[str, Any]) -> bytes:
    return b"".join(b"data: " + orjson.dumps(event) + b"\n\n" for event in events)


def _parse(out: bytes) -> list[Any]:
    """The relayed bytes as a list of JSON objects (and "[DONE]")."""
    assert out.endswith(b"\n\n") or out == b""
    parsed: list[Any] = []
    for raw in out.split(b"\n\n")[:-1]:
        assert raw.startswith(b"data: ")
        payload = raw[6:]
        parsed.append("[DONE]" if payload == b"[DONE]" else orjson.loads(payload))
    return parsed


def _cmpl(
    text: str,
    ids: list[int] | None,
    *,
    prompt_ids: list[int] | None = None,
    finish: str | None = None,
    head: dict[str, Any] = HEAD,
) -> dict[str, Any]:
    """A /v1/completions stream chunk (`ids` None: an engine that returns no ids)."""
    choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": None}
    choice |= {"finish_reason": finish, "stop_reason": None}
    if prompt_ids is not None:
        choice["prompt_token_ids"] = prompt_ids
    if ids is not None:
        choice["token_ids"] = ids
    return {**head, "object": "text_completion", "choices": [choice]}


def _chat(text: str, ids: list[int] | None, *, finish: str | None = None) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "delta": {"content": text}, "logprobs": None}
    choice["finish_reason"] = finish
    if ids is not None:
        choice["token_ids"] = ids
    return {**CHAT_HEAD, "object": "chat.completion.chunk", "choices": [choice]}


def _chat_role(prompt_ids: list[int] | None) -> dict[str, Any]:
    event = _chat("", [] if prompt_ids is not None else None)
    event["choices"][0]["delta"] = {"role": "assistant", "content": ""}
    if prompt_ids is not None:
        event["prompt_token_ids"] = prompt_ids
    return event


def _usage(prompt: int, completion: int, head: dict[str, Any] = HEAD) -> dict[str, Any]:
    usage = {"prompt_tokens": prompt, "total_tokens": prompt + completion}
    usage["completion_tokens"] = completion
    return {**head, "object": "text_completion", "choices": [], "usage": usage}


def _texts(events: list[Any]) -> str:
    out = ""
    for event in events:
        if isinstance(event, dict) and event.get("choices"):
            choice = event["choices"][0]
            out += choice["delta"]["content"] if "delta" in choice else choice["text"]
    return out


def _first_leg_cmpl(body: dict[str, Any], include_usage: bool = False) -> Splice:
    """A completions stream that delivered " a" (11) and " b" (12) over prompt [1, 2, 3]."""
    splice = Splice("completions", body, include_usage)
    splice.relay(_sse(_cmpl(" a", [11], prompt_ids=[1, 2, 3]), _cmpl(" b", [12])))
    return splice


# ------------------------------------------------------------------ whole events, CRLF
def test_an_event_split_across_chunks_is_relayed_once_complete() -> None:
    splice = Splice("completions", {"prompt": "hi"}, False)
    data = _sse(_cmpl(" a", [11], prompt_ids=[1, 2, 3]), _cmpl(" b", [12]))
    cut = data.index(b"\n\n") + 10  # inside the second event
    first = _parse(splice.relay(data[:cut]))
    second = _parse(splice.relay(data[cut:]))
    assert [_texts([e]) for e in first] == [" a"]
    assert [_texts([e]) for e in second] == [" b"]
    assert splice.relay(DONE[:7]) == b""
    assert splice.relay(DONE[7:]) == DONE
    assert splice.done


def test_crlf_events_at_every_split_including_cr_then_lf() -> None:
    events = [_cmpl(" a", [11], prompt_ids=[1, 2, 3]), _cmpl(" b", [12]), _cmpl(" c", [13])]
    data = _sse(*events).replace(b"\n", b"\r\n") + DONE.replace(b"\n", b"\r\n")
    for cut in range(1, len(data)):  # every CRLF is cut once between its CR and its LF
        splice = Splice("completions", {"prompt": "hi"}, False)
        relayed = _parse(splice.relay(data[:cut]) + splice.relay(data[cut:]))
        assert relayed[-1] == "[DONE]", cut
        assert _texts(relayed) == " a b c", cut
        assert len(relayed) == 4, cut


# ------------------------------------------------------------------ token ids
def test_completions_ids_hidden_when_the_client_did_not_ask() -> None:
    splice = Splice("completions", {"prompt": "hi"}, False)
    assert splice.first_body() == {"prompt": "hi", "return_token_ids": True}
    out = splice.relay(_sse(_cmpl(" a", [11], prompt_ids=[1, 2, 3])))
    choice = {"index": 0, "text": " a", "logprobs": None, "finish_reason": None}
    assert _parse(out) == [
        {**HEAD, "object": "text_completion", "choices": [choice | {"stop_reason": None}]}
    ]


def test_chat_ids_hidden_when_the_client_did_not_ask() -> None:
    splice = Splice("chat", {"messages": MESSAGES}, False)
    out = _parse(splice.relay(_sse(_chat_role([1, 2, 3]), _chat(" a", [11]))))
    assert [sorted(event) for event in out] == [["choices", "created", "id", "model", "object"]] * 2
    assert [sorted(event["choices"][0]) for event in out] == [
        ["delta", "finish_reason", "index", "logprobs"]
    ] * 2


def test_ids_kept_on_the_first_leg_when_the_client_asked() -> None:
    body = {"prompt": "hi", "return_token_ids": True}
    splice = Splice("completions", body, False)
    assert splice.first_body() is body
    out = _parse(splice.relay(_sse(_cmpl(" a", [11], prompt_ids=[1, 2, 3]))))
    assert out[0]["choices"][0]["prompt_token_ids"] == [1, 2, 3]
    assert out[0]["choices"][0]["token_ids"] == [11]
    chat = Splice("chat", {"messages": MESSAGES, "return_token_ids": True}, False)
    out = _parse(chat.relay(_sse(_chat_role([1, 2, 3]), _chat(" a", [11]))))
    assert out[0]["prompt_token_ids"] == [1, 2, 3]
    assert [event["choices"][0]["token_ids"] for event in out] == [[], [11]]


# ------------------------------------------------------------------ in-band errors
def test_the_error_event_and_what_follows_are_not_relayed() -> None:
    splice = Splice("completions", {"prompt": "hi"}, False)
    out = splice.relay(_sse(_cmpl(" a", [11], prompt_ids=[1, 2, 3]), ERROR) + DONE)
    assert _texts(_parse(out)) == " a"
    assert len(_parse(out)) == 1
    assert splice.errored
    assert not splice.done
    assert splice.relay(_sse(_cmpl(" b", [12])) + DONE) == b""
    assert splice.delivered == 1


# ------------------------------------------------------------------ completions continuation
def test_completions_continuation_over_token_ids() -> None:
    body = {"model": "m", "prompt": "hi", "max_tokens": 10, "min_tokens": 3, "seed": 7}
    body |= {"temperature": 0.5, "stream": True}
    splice = _first_leg_cmpl(body)
    assert splice.continuation() == Continuation(
        "completions",
        {"model": "m", "prompt": [1, 2, 3, 11, 12], "max_tokens": 8, "min_tokens": 1, "seed": 7}
        | {"temperature": 0.5, "stream": True, "return_token_ids": True},
        TOKEN_IDS,
    )
    assert body["prompt"] == "hi"  # the client's body is left alone


def test_completions_continuation_default_max_tokens_and_min_tokens_floor() -> None:
    cont = _first_leg_cmpl({"prompt": "hi", "min_tokens": 1}).continuation()
    assert cont is not None
    assert cont.body == {
        "prompt": [1, 2, 3, 11, 12],
        "max_tokens": 14,
        "min_tokens": 0,
        "stream": True,
        "return_token_ids": True,
    }


def test_no_completions_continuation_when_finished_or_limit_reached() -> None:
    splice = _first_leg_cmpl({"prompt": "hi", "max_tokens": 10})
    splice.relay(_sse(_cmpl(" c", [13], finish="stop")))
    assert splice.finished
    assert splice.continuation() is None
    assert _first_leg_cmpl({"prompt": "hi", "max_tokens": 2}).continuation() is None
    assert _first_leg_cmpl({"prompt": "hi", "max_tokens": 3}).continuation() is not None


# ------------------------------------------------------------------ chat continuation
def _first_leg_chat(body: dict[str, Any], ids: bool = True, usage: bool = False) -> Splice:
    splice = Splice("chat", body, usage)
    prompt_ids, a, b = ([1, 2, 3], [11], [12]) if ids else (None, None, None)
    splice.relay(_sse(_chat_role(prompt_ids), _chat(" a", a), _chat(" b", b)))
    return splice


def test_chat_continuation_is_a_completion_over_token_ids() -> None:
    body = {"model": "m", "messages": MESSAGES, "max_completion_tokens": 10, "seed": 1}
    body |= {"chat_template_kwargs": {"x": 1}, "logprobs": True, "top_logprobs": 2}
    body |= {"stream": True}
    expected = {"model": "m", "prompt": [1, 2, 3, 11, 12], "max_tokens": 8, "seed": 1}
    expected |= {"stream": True, "return_token_ids": True}
    assert _first_leg_chat(body).continuation() == Continuation("completions", expected, TOKEN_IDS)
    cont = _first_leg_chat({"messages": MESSAGES, "max_tokens": 5}).continuation()
    assert cont is not None
    assert cont.body["max_tokens"] == 3
    cont = _first_leg_chat({"messages": MESSAGES}).continuation()
    assert cont is not None
    assert "max_tokens" not in cont.body


def test_chat_continuation_leg_relayed_as_chat_chunks_with_the_first_head() -> None:
    splice = _first_leg_chat({"messages": MESSAGES})
    cont = splice.continuation()
    assert cont is not None
    splice.start_leg(cont)
    other = {"id": "cmpl-9", "created": 200, "model": "m2"}
    out = _parse(splice.relay(_sse(_cmpl(" c", [13], prompt_ids=[1, 2, 3, 11, 12], head=other))))
    choice = {"index": 0, "delta": {"content": " c"}, "logprobs": None}
    choice |= {"finish_reason": None, "stop_reason": None}
    assert out == [{**CHAT_HEAD, "object": "chat.completion.chunk", "choices": [choice]}]


# ------------------------------------------------------------------ usage across legs
def test_continuation_usage_counts_the_original_prompt_and_every_token_once() -> None:
    body = {"prompt": "hi", "max_tokens": 4, "stream_options": {"include_usage": True}}
    splice = _first_leg_cmpl(body, include_usage=True)
    first = _parse(splice.relay(_sse(ERROR) + DONE))
    cont = splice.continuation()
    assert cont is not None
    assert cont.body["prompt"] == [1, 2, 3, 11, 12]
    splice.start_leg(cont)
    other = {"id": "cmpl-9", "created": 200, "model": "m2"}
    leg = _cmpl(" c", [13], prompt_ids=[1, 2, 3, 11, 12], head=other)
    data = _sse(leg, _cmpl(" d", [14], finish="length", head=other), _usage(5, 2, other)) + DONE
    second = _parse(splice.relay(data))
    assert second[-2:] == [_usage(3, 4), "[DONE]"]
    assert all({k: e[k] for k in HEAD} == HEAD for e in second[:-1])
    assert first == []
    assert _texts(second) == " c d"
    assert splice.delivered == 4
    assert splice.continuation() is None


def test_concatenated_text_across_legs_is_every_token_once() -> None:
    splice = Splice("completions", {"prompt": "hi"}, False)
    first = splice.relay(_sse(_cmpl(" a", [11], prompt_ids=[1, 2, 3]), _cmpl(" b", [12]), ERROR))
    cont = splice.continuation()
    assert cont is not None
    splice.start_leg(cont)
    second = splice.relay(_sse(_cmpl(" c", [13], prompt_ids=[1, 2, 3, 11, 12], finish="length")))
    assert _texts(_parse(first + second)) == " a b c"


# ------------------------------------------------------------------ text fallback
def test_completions_text_fallback() -> None:
    splice = Splice("completions", {"prompt": "hi", "max_tokens": 10}, False)
    splice.relay(_sse(_cmpl(" a", None), _cmpl(" b", None)))
    body = {"prompt": "hi a b", "max_tokens": 8, "stream": True, "return_token_ids": True}
    assert splice.continuation() == Continuation("completions", body, TEXT)


def test_chat_text_fallback_continues_the_assistant_message() -> None:
    body = {"messages": MESSAGES, "max_completion_tokens": 10}
    splice = _first_leg_chat(body, ids=False)
    cont = splice.continuation()
    messages = [*MESSAGES, {"role": "assistant", "content": " a b"}]
    expected = {"messages": messages, "continue_final_message": True}
    expected |= {"add_generation_prompt": False, "max_tokens": 8, "stream": True}
    assert cont == Continuation("chat", expected | {"return_token_ids": True}, TEXT)
    assert body == {"messages": MESSAGES, "max_completion_tokens": 10}
    splice.start_leg(cont)
    assert splice.relay(_sse(_chat_role(None) | {"id": "chatcmpl-9"})) == b""
    out = _parse(splice.relay(_sse(_chat(" c", None) | {"id": "chatcmpl-9"})))
    assert out == [_chat(" c", None)]


def test_no_continuation_for_a_token_id_prompt_without_ids_back() -> None:
    splice = Splice("completions", {"prompt": [5, 6], "max_tokens": 10}, False)
    splice.relay(_sse(_cmpl(" a", None)))
    assert splice.delivered == 1
    assert splice.continuation() is None


# ------------------------------------------------------------------ ending
def test_ending_sends_the_missing_usage_then_done() -> None:
    splice = _first_leg_cmpl({"prompt": "hi"}, include_usage=True)
    splice.relay(_sse(_cmpl(" c", [13], finish="length")))
    assert _parse(splice.ending()) == [_usage(3, 3), "[DONE]"]
    assert splice.done
    chat = _first_leg_chat({"messages": MESSAGES}, usage=True)
    chat.relay(_sse(_chat("", [13], finish="length")))
    usage = _usage(3, 3, CHAT_HEAD) | {"object": "chat.completion.chunk"}
    assert _parse(chat.ending()) == [usage, "[DONE]"]


def test_ending_without_include_usage_or_after_usage_is_just_done() -> None:
    splice = _first_leg_cmpl({"prompt": "hi"})
    splice.relay(_sse(_cmpl(" c", [13], finish="length")))
    assert splice.ending() == DONE
    sent = _first_leg_cmpl({"prompt": "hi"}, include_usage=True)
    sent.relay(_sse(_cmpl(" c", [13], finish="length"), _usage(3, 3)))
    assert sent.ending() == DONE


# ------------------------------------------------------------------ migratable
@pytest.mark.parametrize(
    ("endpoint", "body", "expected"),
    [
        ("chat", {"messages": MESSAGES, "response_format": {"type": "json_object"}}, False),
        ("chat", {"messages": MESSAGES, "tools": [{"type": "function"}]}, False),
        ("chat", {"messages": MESSAGES, "tools": []}, True),
        ("completions", {"prompt": "hi", "guided_json": {"type": "object"}}, False),
        ("completions", {"prompt": ["a", "b"]}, False),
        ("completions", {"prompt": [[1, 2], [3]]}, False),
        ("completions", {"prompt": "hi"}, True),
        ("completions", {"prompt": [1, 2, 3]}, True),
        ("completions", {"prompt": ["hi"]}, True),
        ("completions", {"prompt": [[1, 2]]}, True),
        ("chat", {"messages": MESSAGES}, True),
    ],
)
def test_migratable(endpoint: Endpoint, body: dict[str, Any], expected: bool) -> None:
    assert migratable(endpoint, body) is expected


def test_a_completions_continuation_keeps_the_clients_logprobs_and_top_level_fields() -> None:
    """`logprobs` is a completions parameter (only chat's is chat-only): kept, as `user`."""
    splice = _first_leg_cmpl({"prompt": "hi", "logprobs": 2, "user": "u", "max_tokens": 10})
    leg = splice.continuation()
    assert leg is not None
    assert (leg.body["logprobs"], leg.body["user"], leg.body["max_tokens"]) == (2, "u", 8)


# ------------------------------------------------------------------ llama.cpp: ids in logprobs


def _lp(ids: list[int]) -> dict[str, Any]:
    """llama.cpp's `logprobs` for tokens `ids` (one top logprob each)."""
    entry = [{"id": i, "token": "t", "bytes": [116], "logprob": -0.5} for i in ids]
    return {"content": [{**e, "top_logprobs": [e]} for e in entry]}


def _llama_cmpl(text: str, ids: list[int] | None, finish: str | None = None) -> dict[str, Any]:
    choice = {"text": text, "index": 0, "logprobs": _lp(ids) if ids is not None else None}
    choice["finish_reason"] = finish
    return {"choices": [choice], **HEAD, "object": "text_completion"}


def _llama_chat(text: str, ids: list[int]) -> dict[str, Any]:
    choice = {"finish_reason": None, "index": 0, "delta": {"content": text}, "logprobs": _lp(ids)}
    return {"choices": [choice], **CHAT_HEAD, "object": "chat.completion.chunk"}


def test_llamacpp_legs_ask_for_one_logprob_and_the_client_does_not_see_it() -> None:
    body = {"prompt": "Once", "max_tokens": 5, "stream": True}
    splice = Splice("completions", body, False, "logprobs")
    assert splice.first_body() == {**body, "logprobs": 1}
    events = _parse(splice.relay(_sse(_llama_cmpl(" upon", [7]), _llama_cmpl(" a", [8]))))
    assert [e["choices"][0]["logprobs"] for e in events] == [None, None]
    assert splice.delivered == 2
    leg = splice.continuation()
    assert leg == Continuation(
        "completions",
        {"prompt": ["Once", 7, 8], "max_tokens": 3, "stream": True, "logprobs": 1},
        TOKEN_IDS,
    )


def test_llamacpp_logprobs_the_client_asked_for_stay() -> None:
    body = {"prompt": [1, 2], "max_tokens": 5, "stream": True, "logprobs": 2}
    splice = Splice("completions", body, False, "logprobs")
    assert splice.first_body() == body
    events = _parse(splice.relay(_sse(_llama_cmpl(" upon", [7]))))
    assert events[0]["choices"][0]["logprobs"] == _lp([7])
    leg = splice.continuation()
    assert leg is not None and leg.body["prompt"] == [1, 2, 7]
    assert leg.body["logprobs"] == 2


def test_a_llamacpp_chat_continues_over_its_rendered_prompt() -> None:
    body = {"messages": MESSAGES, "max_tokens": 6, "stream": True, "seed": 3}
    splice = Splice("chat", body, False, "logprobs")
    assert splice.first_body() == {**body, "logprobs": True, "top_logprobs": 1}
    role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": None}}]}
    out = splice.relay(_sse({**role, **CHAT_HEAD}, _llama_chat("Hel", [5]), _llama_chat("lo", [6])))
    assert [("logprobs" in e["choices"][0]) for e in _parse(out)] == [False, False, False]
    assert splice.needs_rendered_prompt
    assert splice.continuation() is None  # the rendered prompt is needed
    leg = splice.continuation("<user>hi</user>")
    assert leg is not None and leg.kind == TOKEN_IDS and leg.endpoint == "completions"
    assert leg.body == {
        "prompt": ["<user>hi</user>", 5, 6],
        "max_tokens": 4,
        "stream": True,
        "seed": 3,
        "logprobs": 1,
    }
    splice.start_leg(leg)
    out = splice.relay(_sse(_llama_cmpl("!", [9], finish="length")))
    (event,) = _parse(out)
    assert event["object"] == "chat.completion.chunk" and event["id"] == "chatcmpl-1"
    assert "logprobs" not in event["choices"][0] and event["choices"][0]["delta"] == {
        "content": "!"
    }


def test_a_llamacpp_token_without_its_id_continues_from_text() -> None:
    splice = Splice("completions", {"prompt": "Once", "max_tokens": 5}, False, "logprobs")
    splice.relay(_sse(_llama_cmpl(" upon", [7]), _llama_cmpl(" a", None)))
    leg = splice.continuation()
    assert leg is not None and leg.kind == TEXT
    assert leg.body["prompt"] == "Once upon a" and leg.body["max_tokens"] == 3


def test_a_continuations_text_offsets_follow_the_delivered_text() -> None:
    """vLLM counts a completion's `text_offset` from the start of its own output."""
    splice = _first_leg_cmpl({"prompt": "hi", "max_tokens": 10, "logprobs": 1})
    delivered = len(" a b")
    leg = splice.continuation()
    assert leg is not None
    splice.start_leg(leg)
    event = _cmpl(" c", [13])
    event["choices"][0]["logprobs"] = {"text_offset": [0], "tokens": [" c"]}
    (out,) = _parse(splice.relay(_sse(event)))
    assert out["choices"][0]["logprobs"]["text_offset"] == [delivered]


def test_an_echoed_completion_is_not_migrated() -> None:
    assert not migratable("completions", {"prompt": "hi", "echo": True})
    assert migratable("completions", {"prompt": "hi", "echo": False})
