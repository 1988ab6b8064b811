"""The simulator's pure pieces: tokenizer, KV blocks, generation, shapes, store, faults."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from narwhal.clock import FakeClock
from narwhal.sim.faults import FaultBook, FaultKind, FaultSpec
from narwhal.sim.generation import VOCAB, RollingDigest, generate, text_of
from narwhal.sim.handoff import GARBAGE_PARAMS, parse_handoff, produced_params
from narwhal.sim.kv import BLOCK_SIZE, blocks_of, context_from_blocks, digest
from narwhal.sim.kv_store import KvLoadError, KvStore
from narwhal.sim.leg import Leg, leg_of
from narwhal.sim.request_log import RequestLog
from narwhal.sim.requests import CompletionBody, RequestError, parse
from narwhal.sim.shapes import ChunkTemplate, Envelope, error_body, response_body, usage
from narwhal.sim.tokens import render_chat, tokenize

token_ids = st.lists(st.integers(0, (1 << 31) - 1), min_size=1, max_size=80)


def test_vocabulary_is_256_distinct_words() -> None:
    assert len(VOCAB) == len(set(VOCAB)) == 256
    assert all(w and " " not in w for w in VOCAB)


def test_tokens_are_words_and_chat_adds_one_template_token_per_message_plus_one() -> None:
    assert len(tokenize("  the quick\tbrown \n fox ")) == 4
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    assert len(tokenize(render_chat(messages))) == 4 + 2 + 1
    assert len(tokenize(render_chat(messages, add_generation_prompt=False))) == 4 + 2
    parts = [{"type": "text", "text": "hi"}, {"type": "image_url"}, {"type": "text", "text": "x"}]
    assert render_chat([{"role": "user", "content": parts}]) == "<|user|> hi x\n<|assistant|>"


@settings(deadline=None)
@given(token_ids)
def test_a_decode_rebuilds_the_prefill_context_from_the_blocks(ids: list[int]) -> None:
    blocks = blocks_of(ids)
    assert all(len(b) == BLOCK_SIZE for b in blocks[:-1])
    assert context_from_blocks(blocks, ids) == ids
    assert digest(context_from_blocks(blocks, [])) == digest(ids)


def test_the_kv_wins_over_the_local_prompt() -> None:
    a, b = tokenize("one two three"), tokenize("four five six")
    assert context_from_blocks(blocks_of(a), b) == a
    assert context_from_blocks(blocks_of(a), [*b, 7]) == [*a, 7]
    assert digest(a) != digest(b)


@settings(deadline=None)
@given(st.lists(st.integers(0, 1 << 20), min_size=1, max_size=40), st.integers(1, 60))
def test_generation_is_a_prefix_stable_function_of_the_context(ids: list[int], n: int) -> None:
    assert generate(ids, n).indices == generate(ids, n + 7).indices[:n]
    assert generate(ids, n).finish_reason == "length"


@settings(deadline=None)
@given(st.lists(st.integers(0, 1 << 20), min_size=1, max_size=40), st.integers(0, 40))
def test_a_generation_continued_from_its_first_k_tokens_is_the_rest_of_it(
    ids: list[int], k: int
) -> None:
    """What a router's migration relies on: prompt + the delivered token ids as the new
    prompt give exactly the tokens that were not delivered yet, and their text joins."""
    whole = generate(ids, 40)
    rest = generate([*ids, *whole.token_ids[:k]], 40 - k)
    assert whole.indices[:k] + rest.indices == whole.indices
    assert text_of(whole.indices[:k]) + text_of(rest.indices) == text_of(whole.indices)


def test_the_rolling_digest_is_the_kv_digest_at_every_length() -> None:
    ids = list(range(100, 150))
    rolling = RollingDigest(ids[:5])
    for n in range(5, 50):
        assert rolling.value() == digest(ids[:n])
        rolling.append(ids[n])


def test_a_stop_word_ends_generation_unemitted_after_min_tokens() -> None:
    ids = tokenize("a prompt of some words")
    words = [VOCAB[i] for i in generate(ids, 8).indices]
    third = words[2]
    cut = words.index(third)  # the first occurrence
    stopped = generate(ids, 8, [f" {third} "])
    assert stopped.finish_reason == "stop"
    assert stopped.stop_reason == f" {third} "
    assert [VOCAB[i] for i in stopped.indices] == words[:cut]
    assert len(generate(ids, 8, [third], min_tokens=cut + 1).indices) > cut


def _events(env: Envelope, indices: tuple[int, ...], finish: str) -> list[dict[str, Any]]:
    tpl = ChunkTemplate(env)
    raw = [tpl.token(w) for w in indices]
    raw.append(tpl.final(None, finish, None))
    return [json.loads(e.removeprefix(b"data: ")) for e in raw]


@settings(deadline=None)
@given(
    st.lists(st.integers(0, 1 << 20), min_size=1, max_size=20), st.integers(1, 40), st.booleans()
)
def test_streamed_chunks_are_json_and_add_up_to_the_answer(
    ids: list[int], n: int, chat: bool
) -> None:
    env = Envelope(chat=chat, id="cmpl-x", created=1, model='m"odel')
    gen = generate(ids, n)
    chunks = _events(env, gen.indices, "length")
    key = "delta" if chat else "text"
    texts = [c["choices"][0][key]["content"] if chat else c["choices"][0][key] for c in chunks]
    assert "".join(texts) == text_of(gen.indices)
    body = response_body(env, gen, usage(3, n, 0), {"kv_transfer_params": None})
    answer = body["choices"][0]["message"]["content"] if chat else body["choices"][0]["text"]
    assert answer == "".join(texts)
    assert {c["object"] for c in chunks} == {"chat.completion.chunk" if chat else "text_completion"}
    assert {c["model"] for c in chunks} == {'m"odel'}


def test_error_body_is_vllms_shape() -> None:
    assert error_body(404, "nope", "model") == {
        "error": {"message": "nope", "type": "NotFoundError", "param": "model", "code": 404}
    }
    assert error_body(503, "x")["error"]["type"] == "ServiceUnavailableError"


def test_kv_store_hands_over_once_and_expires() -> None:
    clock = FakeClock()
    store = KvStore(clock, ttl_s=10.0)
    ids = store.put("r1", [(1, 2), (3,)])
    assert ids == [0, 1]
    assert store.put("r2", [(4,)]) == [2]
    with pytest.raises(KvLoadError, match="do not match"):
        store.take("r1", [0])
    assert store.take("r1", ids) == ((1, 2), (3,))
    with pytest.raises(KvLoadError, match="already read"):
        store.take("r1", ids)
    assert store.held() == 1
    clock.advance(10.0)
    assert store.held() == 0
    with pytest.raises(KvLoadError, match="expired"):
        store.take("r2", [2])
    store.put("r3", [(5,)])
    store.clear()
    assert store.held() == 0


@pytest.mark.parametrize(
    ("params", "leg"),
    [
        (None, Leg.UNIFIED),
        ("x", Leg.UNIFIED),
        ({"do_remote_decode": False, "do_remote_prefill": False}, Leg.UNIFIED),
        ({"do_remote_decode": True}, Leg.PREFILL),
        ({"do_remote_prefill": True}, Leg.DECODE),
        ({"do_remote_prefill": True, "do_remote_decode": True}, Leg.DECODE),
        ({"do_remote_decode": "yes"}, Leg.UNIFIED),
    ],
)
def test_leg_of(params: Any, leg: Leg) -> None:
    assert leg_of(params) is leg


def test_parse_handoff_accepts_what_a_prefill_produces() -> None:
    h = parse_handoff(produced_params("e", "r", [1, 2], "127.0.0.1", 4000))
    assert (h.engine_id, h.request_id, h.block_ids, h.host, h.port) == (
        "e",
        "r",
        (1, 2),
        "127.0.0.1",
        4000,
    )


@pytest.mark.parametrize(
    "change",
    [
        {"remote_engine_id": None},
        {"remote_request_id": 5},
        {"remote_host": ["h"]},
        {"remote_block_ids": "x"},
        {"remote_block_ids": [1, True]},
        {"remote_port": "nope"},
        {"remote_port": 0},
        {"remote_port": True},
        GARBAGE_PARAMS,
    ],
)
def test_parse_handoff_rejects_malformed_params(change: dict[str, Any]) -> None:
    params = produced_params("e", "r", [1], "h", 4000) | change
    with pytest.raises(KvLoadError, match="malformed kv_transfer_params"):
        parse_handoff(params)


def test_completion_body_validation() -> None:
    assert parse(CompletionBody, {"prompt": [1, 2, 3]}).prompt_ids() == [1, 2, 3]
    assert parse(CompletionBody, {"prompt": [[1, 2]]}).prompt_ids() == [1, 2]
    assert parse(CompletionBody, {"prompt": ["a b"]}).prompt_ids() == tokenize("a b")
    assert parse(CompletionBody, {"prompt": "x", "stop": "y"}).stop_strings == ["y"]
    with pytest.raises(RequestError, match="batched"):
        parse(CompletionBody, {"prompt": ["a", "b"]}).prompt_ids()
    for bad in ({}, {"prompt": "x", "max_tokens": 0}, {"prompt": [-1]}, {"prompt": "x", "n": "z"}):
        with pytest.raises(RequestError) as err:
            parse(CompletionBody, bad)
        assert err.value.status == 400


def test_fault_spec_validation() -> None:
    assert FaultSpec.model_validate({"kind": "no_done", "leg": "any"}).leg is None
    spec = FaultSpec.model_validate({"kind": "completion_status", "status": 503, "leg": "decode"})
    assert spec.to_json() == {
        "kind": "completion_status",
        "leg": "decode",
        "count": None,
        "probability": None,
        "status": 503,
    }
    for bad in (
        {"kind": "completion_status"},
        {"kind": "no_done", "status": 500},
        {"kind": "nope"},
        {"kind": "slow", "factor": 0},
        {"kind": "no_done", "typo": 1},
        {"kind": "no_done", "probability": 2},
    ):
        with pytest.raises(ValueError):
            FaultSpec.model_validate(bad)


def test_fault_book_targets_legs_and_counts_firings() -> None:
    fired: list[FaultKind] = []
    book = FaultBook(random.Random(1), fired.append)
    spec = FaultSpec(kind=FaultKind.NO_DONE, leg=Leg.DECODE, count=2)
    fault = book.add(spec)
    assert book.fire(FaultKind.NO_DONE, Leg.PREFILL) is None
    assert book.fire(FaultKind.MALFORMED_EVENT, Leg.DECODE) is None
    assert book.fire(FaultKind.NO_DONE, Leg.DECODE) is fault
    assert book.fire(FaultKind.NO_DONE, None) is fault  # not a completion: any leg
    assert book.fire(FaultKind.NO_DONE, Leg.DECODE) is None
    assert fault.fired == 2
    assert fired == [FaultKind.NO_DONE, FaultKind.NO_DONE]
    assert book.remove(fault.id)
    assert not book.remove(fault.id)
    assert book.snapshot() == []


def test_fault_probability_uses_the_injected_rng() -> None:
    def run(seed: int) -> list[bool]:
        book = FaultBook(random.Random(seed), lambda _: None)
        book.add(FaultSpec(kind=FaultKind.NO_DONE, probability=0.3))
        return [book.fire(FaultKind.NO_DONE, Leg.UNIFIED) is not None for _ in range(400)]

    first = run(5)
    assert first == run(5)
    assert 60 < sum(first) < 180


def test_request_log_keeps_the_last_200() -> None:
    log = RequestLog()
    for i in range(250):
        log.record("/v1/completions", {"X-Request-Id": str(i)}, {"i": i}, Leg.UNIFIED)
    entries = log.entries()
    assert len(entries) == 200
    assert entries[0]["body"] == {"i": 50}
    assert entries[-1] == {
        "path": "/v1/completions",
        "headers": {"x-request-id": "249"},
        "body": {"i": 249},
        "leg": "unified",
    }


@pytest.mark.parametrize("chat", [False, True])
def test_token_ids_asked_for_come_with_every_chunk_and_the_prompt_once(chat: bool) -> None:
    """vLLM's `return_token_ids`: completions put the prompt's ids on the first token's
    choice, chat at the top of the role event; every content event has its `token_ids`."""
    prompt = (5, 6, 7)
    env = Envelope(chat=chat, id="x", created=1, model="m", prompt_ids=prompt)
    gen = generate(list(prompt), 5)
    tpl = ChunkTemplate(env)
    raw = ([tpl.role()] if chat else []) + [tpl.token(w) for w in gen.indices[:-1]]
    raw.append(tpl.final(gen.indices[-1], "length", None))
    chunks = [json.loads(e.removeprefix(b"data: ")) for e in raw]
    ids = [t for c in chunks for t in c["choices"][0]["token_ids"]]
    assert ids == list(gen.token_ids)
    if chat:
        assert chunks[0]["prompt_token_ids"] == list(prompt)
        assert all("prompt_token_ids" not in c for c in chunks[1:])
    else:
        assert chunks[0]["choices"][0]["prompt_token_ids"] == list(prompt)
        assert all("prompt_token_ids" not in c["choices"][0] for c in chunks[1:])
    body = response_body(env, gen, usage(3, 5, 0), {})
    assert body["choices"][0]["token_ids"] == list(gen.token_ids)
    where = body if chat else body["choices"][0]
    assert where["prompt_token_ids"] == list(prompt)
