"""The NixlConnector handoff across real processes: prefill here, decode there, same text."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.sim_process import SimFactory, SimProcess

from .helpers import complete, decode_body, post, prefill_body, sse_data, stream_text, text_of

PROMPT = " ".join(f"word{i}" for i in range(37))  # 37 tokens: 3 blocks
BODY: dict[str, Any] = {"model": "demo-model", "prompt": PROMPT, "max_tokens": 12}


@pytest.fixture(scope="module")
def fleet(module_sims: SimFactory) -> dict[str, SimProcess]:
    names = ("prefill", "decode", "recompute", "unified")
    sims = module_sims.start_many(
        [
            ["--role", "prefill", "--kv-role", "kv_producer", "--itl-ms", "0"],
            ["--role", "decode", "--kv-role", "kv_consumer", "--itl-ms", "0"],
            ["--role", "decode", "--kv-role", "kv_consumer", "--itl-ms", "0",
             "--kv-load-failure-policy", "recompute"],
            ["--itl-ms", "0"],
        ]
    )  # fmt: skip
    return dict(zip(names, sims, strict=True))


@pytest.fixture
def sims(fleet: dict[str, SimProcess]) -> Iterator[dict[str, SimProcess]]:
    yield fleet
    for sim in fleet.values():
        sim.clear_faults()


def prefill(sim: SimProcess, body: dict[str, Any], chat: bool = False) -> dict[str, Any]:
    answer = complete(sim, prefill_body(body), chat=chat)
    params = answer["kv_transfer_params"]
    assert isinstance(params, dict), answer
    return params


def decode_error(sim: SimProcess, body: dict[str, Any], params: Any) -> str:
    status, err = post(sim, "/v1/completions", decode_body(body, params))
    assert status == 500, err
    return str(err["error"]["message"])


def test_a_pd_round_trip_produces_the_unified_text(sims: dict[str, SimProcess]) -> None:
    reference = complete(sims["unified"], BODY)
    first = complete(sims["prefill"], prefill_body(BODY))
    assert first["choices"][0]["finish_reason"] == "length"
    assert text_of(first) == " " + text_of(reference).split()[0]
    params = first["kv_transfer_params"]
    assert params["do_remote_prefill"] is True
    assert params["do_remote_decode"] is False
    assert params["tp_size"] == 1
    assert len(params["remote_block_ids"]) == 3
    assert all(isinstance(b, int) for b in params["remote_block_ids"])
    assert params["remote_host"] == "127.0.0.1"
    assert params["remote_port"] != sims["prefill"].port
    assert params["remote_engine_id"] == sims["prefill"].get_json("/server_info")["engine_id"]

    answer = complete(sims["decode"], decode_body(BODY, params))
    assert text_of(answer) == text_of(reference)
    assert answer["usage"]["prompt_tokens"] == 37
    assert answer["usage"]["prompt_tokens_details"] == {"cached_tokens": 37}
    assert answer["kv_transfer_params"] is None
    assert sims["decode"].requests()[-1]["leg"] == "decode"


def test_a_streamed_chat_decode_produces_the_unified_text(sims: dict[str, SimProcess]) -> None:
    chat = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 7, "stream": True}
    reference = stream_text(sse_data(sims["unified"].http("POST", "/v1/chat/completions", chat)[1]))
    params = prefill(sims["prefill"], chat, chat=True)
    status, raw = sims["decode"].http("POST", "/v1/chat/completions", decode_body(chat, params))
    assert status == 200
    events = sse_data(raw)
    assert events[-1] == "[DONE]"
    assert stream_text(events) == reference
    assert len(reference.split()) == 7


def test_the_blocks_moved_once_and_are_counted(sims: dict[str, SimProcess]) -> None:
    served = sims["prefill"].metric("narwhal_sim_kv_blocks_served_total")
    received = sims["decode"].metric("narwhal_sim_kv_blocks_received_total")
    params = prefill(sims["prefill"], BODY)
    assert sims["prefill"].metric("narwhal_sim_kv_handoffs_held") >= 1
    complete(sims["decode"], decode_body(BODY, params))
    assert sims["prefill"].metric("narwhal_sim_kv_blocks_served_total") == served + 3
    assert sims["decode"].metric("narwhal_sim_kv_blocks_received_total") == received + 3


def test_a_handoff_is_used_at_most_once(sims: dict[str, SimProcess]) -> None:
    reference = text_of(complete(sims["unified"], BODY))
    params = prefill(sims["prefill"], BODY)
    complete(sims["decode"], decode_body(BODY, params))
    message = decode_error(sims["decode"], BODY, params)
    assert "KV load failed" in message
    assert "already read" in message

    recomputes = sims["recompute"].metric("narwhal_sim_kv_recomputes_total")
    again = complete(sims["recompute"], decode_body(BODY, params))
    assert text_of(again) == reference
    assert again["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert sims["recompute"].metric("narwhal_sim_kv_recomputes_total") == recomputes + 1


def test_expired_blocks_cannot_be_read(
    sim_factory: SimFactory, sims: dict[str, SimProcess]
) -> None:
    short_lived = sim_factory("--kv-role", "kv_producer", "--kv-ttl-s", "0")
    params = prefill(short_lived, BODY)
    assert "expired" in decode_error(sims["decode"], BODY, params)


def test_a_wrong_engine_id_cannot_be_read(sims: dict[str, SimProcess]) -> None:
    params = prefill(sims["prefill"], BODY) | {"remote_engine_id": "someone-else"}
    assert "someone-else" in decode_error(sims["decode"], BODY, params)


def test_malformed_params_cannot_be_read(sims: dict[str, SimProcess]) -> None:
    params = {"do_remote_prefill": True, "remote_engine_id": "e"}
    assert "malformed kv_transfer_params" in decode_error(sims["decode"], BODY, params)


def test_a_dead_side_channel_fails_or_recomputes(
    sim_factory: SimFactory, sims: dict[str, SimProcess]
) -> None:
    doomed = sim_factory("--kv-role", "kv_producer")
    params = prefill(doomed, BODY)
    doomed.kill()
    assert "unreachable" in decode_error(sims["decode"], BODY, params)
    answer = complete(sims["recompute"], decode_body(BODY, params))
    assert text_of(answer) == text_of(complete(sims["unified"], BODY))
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_a_handoff_from_another_prompt_changes_the_text(sims: dict[str, SimProcess]) -> None:
    other = BODY | {"prompt": " ".join(f"other{i}" for i in range(37))}
    params = prefill(sims["prefill"], other)
    answer = complete(sims["decode"], decode_body(BODY, params))
    assert text_of(answer) != text_of(complete(sims["unified"], BODY))
    # The KV decides: the text is the other prompt's (same length, so the KV covers it all).
    assert text_of(answer) == text_of(complete(sims["unified"], other))


def test_a_kv_consumer_produces_no_handoff(sims: dict[str, SimProcess]) -> None:
    answer = complete(sims["decode"], prefill_body(BODY))
    assert answer["choices"][0]["finish_reason"] == "length"
    assert answer["kv_transfer_params"] is None


def test_a_kv_producer_refuses_to_consume(sims: dict[str, SimProcess]) -> None:
    params = prefill(sims["prefill"], BODY)
    message = decode_error(sims["prefill"], BODY, params)
    assert message == "KV transfer not permitted for kv_producer"


def test_a_prefill_that_hits_a_stop_string_hands_nothing_off(sims: dict[str, SimProcess]) -> None:
    first_word = text_of(complete(sims["unified"], BODY)).split()[0]
    answer = complete(sims["prefill"], prefill_body(BODY | {"stop": [first_word]}))
    assert answer["choices"][0]["finish_reason"] == "stop"
    assert answer["choices"][0]["text"] == ""
    assert answer["kv_transfer_params"] is None


def test_sglang_bootstrap_fields_are_ignored(sims: dict[str, SimProcess]) -> None:
    body = BODY | {"bootstrap_host": "h", "bootstrap_port": 1, "bootstrap_room": 7}
    assert text_of(complete(sims["unified"], body)) == text_of(complete(sims["unified"], BODY))
