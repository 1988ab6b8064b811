"""vLLM's endpoints as a router probes them, plus the peer-router probes and /sim/requests."""

from __future__ import annotations

import asyncio
import base64
import json
import struct

import aiohttp
import pytest

from tests.support.poll import eventually
from tests.support.sim_process import SimFactory, SimProcess

from .helpers import complete, post


def test_health_is_an_empty_200(unified: SimProcess) -> None:
    assert unified.http("GET", "/health") == (200, b"")


def test_models_reports_max_model_len(sim_factory: SimFactory) -> None:
    sim = sim_factory("--max-model-len", "512", "--model", "m1")
    models = sim.get_json("/v1/models")
    card = models["data"][0]
    assert models["object"] == "list"
    assert {
        k: card[k] for k in ("id", "object", "owned_by", "root", "parent", "max_model_len")
    } == {
        "id": "m1",
        "object": "model",
        "owned_by": "vllm",
        "root": "m1",
        "parent": None,
        "max_model_len": 512,
    }
    info = sim.get_json("/server_info")
    assert (info["served_model_name"], info["max_model_len"]) == ("m1", 512)


def test_metrics_carry_vllm_names_and_the_generation(unified: SimProcess) -> None:
    text = unified.metrics()
    for name in (
        "process_start_time_seconds",
        'vllm:num_requests_running{model_name="demo-model"}',
        'vllm:num_requests_waiting{model_name="demo-model"}',
        'narwhal_sim_requests_total{leg="prefill"}',
        "narwhal_sim_kv_blocks_served_total",
        "narwhal_sim_kv_blocks_received_total",
        "narwhal_sim_kv_recomputes_total",
    ):
        assert name in text, name
    assert unified.process_start_time() > 1_000_000_000


def test_tokenize_counts_what_a_completion_charges(unified: SimProcess) -> None:
    status, tok = post(unified, "/tokenize", {"prompt": "a b  c", "model": "demo-model"})
    assert status == 200
    assert tok["count"] == len(tok["tokens"]) == 3
    assert (tok["max_model_len"], tok["token_strs"]) == (4096, None)
    messages = [{"role": "user", "content": "hello there"}]
    status, chat_tok = post(unified, "/tokenize", {"messages": messages})
    answer = complete(unified, {"messages": messages, "max_tokens": 1}, chat=True)
    assert chat_tok["count"] == answer["usage"]["prompt_tokens"] == 2 + 1 + 1
    assert post(unified, "/tokenize", {"model": "other", "prompt": "x"})[0] == 404
    assert post(unified, "/tokenize", {})[0] == 400


def test_an_over_length_prompt_is_a_500_as_vllm_answers_it(sim_factory: SimFactory) -> None:
    sim = sim_factory("--max-model-len", "8")
    status, tok = post(sim, "/tokenize", {"prompt": "w " * 9})
    assert (status, tok["count"]) == (200, 9)
    assert complete(sim, {"prompt": "w " * 8, "max_tokens": 1})["usage"]["prompt_tokens"] == 8
    status, err = post(sim, "/v1/completions", {"prompt": "w " * 9, "max_tokens": 1})
    assert status == 500
    assert err["error"]["code"] == 500
    assert err["error"]["type"] == "InternalServerError"
    assert "maximum model length of 8" in err["error"]["message"]


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"model": "nope", "prompt": "x"}, 404, "model"),
        ({"prompt": "x", "n": 2}, 400, "n"),
        ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ({"max_tokens": 3}, 400, "prompt"),
        ({"prompt": ""}, 400, "prompt"),
        ([1, 2], 400, None),
    ],
)
def test_bad_requests_get_vllms_error_shape(
    unified: SimProcess, body: object, status: int, param: str | None
) -> None:
    got, err = post(unified, "/v1/completions", body)
    assert got == status
    assert set(err["error"]) == {"message", "type", "param", "code"}
    assert (err["error"]["code"], err["error"]["param"]) == (status, param)


def test_invalid_json_is_a_400(unified: SimProcess) -> None:
    import urllib.request

    req = urllib.request.Request(unified.url + "/v1/completions", data=b"{nope", method="POST")
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=5)
    assert err.value.code == 400
    assert "not a JSON object" in json.loads(err.value.read())["error"]["message"]


def test_the_response_id_carries_the_request_id(unified: SimProcess) -> None:
    body = {"prompt": "x y", "max_tokens": 1}
    status, answer = post(unified, "/v1/completions", body, **{"X-Request-Id": "abc-123"})
    assert (status, answer["id"]) == (200, "cmpl-abc-123")
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
    status, answer = post(unified, "/v1/chat/completions", chat, **{"X-Request-Id": "r9"})
    assert answer["id"] == "chatcmpl-r9"


def test_sim_requests_records_headers_bodies_and_legs(unified: SimProcess) -> None:
    body = {"prompt": "x y", "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    headers = {"X-Request-Id": "rid-1", "Authorization": "Bearer s3cret"}
    assert post(unified, "/v1/completions", body, **headers)[0] == 200
    assert post(unified, "/v1/chat/completions", {"messages": []})[0] == 400
    first, second = unified.requests()
    assert first["path"] == "/v1/completions"
    assert first["body"] == body
    assert first["leg"] == "prefill"
    assert first["headers"]["x-request-id"] == "rid-1"
    assert first["headers"]["authorization"] == "Bearer s3cret"
    assert (second["path"], second["leg"]) == ("/v1/chat/completions", "unified")
    unified.clear_requests()
    assert unified.requests() == []


def test_peer_router_probes_answer_json(unified: SimProcess) -> None:
    for path in ("/server_info", "/get_server_info"):
        info = unified.get_json(path)
        assert {"model_path", "served_model_name", "max_model_len", "role", "engine_id"} <= set(
            info
        )
    for path in ("/model_info", "/get_model_info"):
        assert unified.get_json(path)["model_path"] == "demo-model"
    for path in ("/v1/loads", "/get_load"):
        assert unified.get_json(path)["running"] == 0
    assert "version" in unified.get_json("/version")


async def test_above_max_concurrency_completions_get_a_429(sim_factory: SimFactory) -> None:
    sim = sim_factory("--max-concurrency", "2")
    sim.add_fault({"kind": "stall_first_token", "delay_s": 30})
    body = {"prompt": "x", "max_tokens": 1}
    async with aiohttp.ClientSession() as session:

        async def hold() -> None:
            async with session.post(sim.url + "/v1/completions", json=body) as resp:
                await resp.read()

        held = [asyncio.create_task(hold()) for _ in range(2)]
        await eventually(
            lambda: sim.get_json("/v1/loads")["running"] == 2, what="two requests in flight"
        )
        sim.clear_faults()
        async with session.post(sim.url + "/v1/completions", json=body) as resp:
            assert resp.status == 429
            assert (await resp.json())["error"]["code"] == 429
        assert sim.metric("vllm:num_requests_running") == 2
        for task in held:
            task.cancel()
        await asyncio.gather(*held, return_exceptions=True)
    # A client that leaves frees its slot (the handler is cancelled).
    await eventually(lambda: sim.get_json("/v1/loads")["running"] == 0, what="slots freed")
    assert complete(sim, body)["choices"][0]["finish_reason"] == "length"


def test_an_embed_engine_serves_embeddings_and_refuses_completions(
    sim_factory: SimFactory,
) -> None:
    """`--role embed` is a pooling model: a unit vector per input, the same for the same
    input, as floats or as base64 little-endian float32; no completions."""
    sim = sim_factory("--role", "embed", "--model", "bge")
    status, got = post(sim, "/v1/embeddings", {"model": "bge", "input": ["a b", "c", "a b"]})
    assert status == 200
    vectors = [d["embedding"] for d in got["data"]]
    assert [d["index"] for d in got["data"]] == [0, 1, 2]
    assert vectors[0] == vectors[2] != vectors[1]
    assert abs(sum(x * x for x in vectors[0]) - 1) < 1e-9
    assert got["usage"] == {"prompt_tokens": 5, "total_tokens": 5}
    status, packed = post(sim, "/v1/embeddings", {"input": "a b", "encoding_format": "base64"})
    raw = base64.b64decode(packed["data"][0]["embedding"])
    assert struct.unpack("<16f", raw) == pytest.approx(vectors[0], rel=1e-6)
    status, short = post(sim, "/v1/embeddings", {"input": "a b", "dimensions": 4})
    assert len(short["data"][0]["embedding"]) == 4
    status, refused = post(sim, "/v1/completions", {"prompt": "x", "max_tokens": 1})
    assert status == 400 and "does not support Completions" in refused["error"]["message"]
    status, bad = post(sim, "/v1/embeddings", {"input": 3})
    assert status == 400 and bad["error"]["param"].startswith("input")


def test_a_generative_engine_refuses_embeddings(unified: SimProcess) -> None:
    status, refused = post(unified, "/v1/embeddings", {"input": "x"})
    assert status == 400 and "does not support Embeddings" in refused["error"]["message"]
