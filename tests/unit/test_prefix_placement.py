"""The data plane's cache-aware placement: prompt keys, the ranking over candidates, and the
index's hygiene as the fleet changes (an engine out of service or restarted holds nothing)."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest

from narwhal.clock import FakeClock
from narwhal.config import Role, parse_config
from narwhal.dataplane.prefix import RETELL_SHARE, PrefixPlacement, events_of
from narwhal.dataplane.requests import parse_request
from narwhal.fleet.events import Readmitted
from narwhal.fleet.holds import Hold, HoldName
from narwhal.fleet.state import Candidate, Ejection, EngineState
from narwhal.fleet.store import Fleet
from narwhal.placement.keys import prompt_keys
from narwhal.placement.load import EngineLoad

CONFIG = parse_config(
    {
        "model": "m",
        "engines": [
            {"id": "p0", "url": "http://10.0.0.1:8000", "role": "prefill"},
            {"id": "p1", "url": "http://10.0.0.2:8000", "role": "prefill"},
            {"id": "d0", "url": "http://10.0.0.3:8000", "role": "decode"},
        ],
        "placement": {"policy": "prefix", "kv_events_port": 5557},
    }
)
PROMPT = "the same long system prompt for every question " * 20


def states() -> dict[str, EngineState]:
    return {e.id: EngineState(config=e, role=e.role, generation=1.0) for e in CONFIG.engines}


def placed_on(prefix: PrefixPlacement, engine: str) -> None:
    req = parse_request("completions", _body(PROMPT + "first"), "m")
    prompt = prefix.prompt_now(req, "m")
    assert prompt is not None
    prefix.placed(prompt, engine, 0)


def _body(prompt: str) -> bytes:
    return b'{"model": "m", "prompt": "%s", "max_tokens": 1}' % prompt.encode()


def first_choice(prefix: PrefixPlacement, in_flight: dict[str, int] | None = None) -> str:
    req = parse_request("completions", _body(PROMPT + "second"), "m")
    prompt = prefix.prompt_now(req, "m")
    assert prompt is not None and prompt.keys
    loads = in_flight or {}
    candidates = [Candidate(e, loads.get(e, 0)) for e in ("p0", "p1")]
    return prefix.choose(prompt, Role.PREFILL, candidates, turn=0)[0].id


def test_a_placed_prefix_draws_the_next_request_with_it_until_the_engine_leaves_service() -> None:
    clock = FakeClock()
    prefix = PrefixPlacement(CONFIG, clock)
    fleet = states()
    prefix.sync(fleet.values(), clock.monotonic())
    assert first_choice(prefix) == "p0"  # no match: rotation's first
    placed_on(prefix, "p1")
    assert first_choice(prefix) == "p1"
    assert first_choice(prefix, {"p1": 1}) == "p1", "its first prefill ahead does not move it"

    ejection = Ejection("connection", "refused", 0.0, {})
    fleet["p1"] = replace(fleet["p1"], ejected=ejection)
    prefix.sync(fleet.values(), clock.monotonic())
    assert prefix.index.index_blocks("p1") == 0
    assert first_choice(prefix) == "p0"


def test_each_engine_s_queue_is_charged_what_its_recent_prefills_computed() -> None:
    """The ranking charges each request queued on an engine the uncached tokens of the
    prefills lately placed there (a moving average): a queue of cached requests is cheap, so
    the prefix holds its engine under more load than a queue of misses would allow."""
    clock = FakeClock()
    prefix = PrefixPlacement(CONFIG, clock)
    prefix.sync(states().values(), clock.monotonic())
    req = parse_request("completions", _body(PROMPT + "first"), "m")
    prompt = prefix.prompt_now(req, "m")
    assert prompt is not None
    prefix.placed(prompt, "p1", 0)  # a miss: every token computed
    candidates = [Candidate("p0", 0), Candidate("p1", 3)]
    loads = {c.id: prefix.load(c, clock.monotonic()) for c in candidates}
    assert loads["p0"].tokens_per_request is None
    assert loads["p1"].tokens_per_request == prompt.tokens
    for _ in range(30):  # then hits, computing one block each
        prefix.placed(prompt, "p1", prompt.tokens - 16)
    p1 = prefix.load(Candidate("p1", 3), clock.monotonic())
    assert p1.tokens_per_request is not None and 16 <= p1.tokens_per_request < 20
    prefix.placed(prompt, "d0", 0, prefill=False)  # a decode leg: no prefill work charged
    assert prefix.load(Candidate("d0", 1), clock.monotonic()).tokens_per_request is None


def test_a_new_generation_or_a_maintenance_hold_empties_the_engine() -> None:
    clock = FakeClock()
    prefix = PrefixPlacement(CONFIG, clock)
    fleet = states()
    prefix.sync(fleet.values(), clock.monotonic())
    placed_on(prefix, "p1")
    fleet["p1"] = replace(fleet["p1"], generation=2.0)  # restarted: a new process
    prefix.sync(fleet.values(), clock.monotonic())
    assert prefix.index.index_blocks("p1") == 0

    placed_on(prefix, "p1")
    hold = Hold(HoldName.PLANNED_MAINTENANCE, "operator", 0.0)
    fleet["p1"] = replace(fleet["p1"], holds={hold.name: hold})
    prefix.sync(fleet.values(), clock.monotonic())
    assert prefix.index.index_blocks("p1") == 0


def test_a_generation_first_learned_is_not_a_restart() -> None:
    """llama.cpp's generation is known only once the engine answered, after the router may
    have placed on it: learning it keeps what the index holds."""
    clock = FakeClock()
    prefix = PrefixPlacement(CONFIG, clock)
    fleet = {k: replace(v, generation=None) for k, v in states().items()}
    prefix.sync(fleet.values(), clock.monotonic())
    placed_on(prefix, "p1")
    held = prefix.index.index_blocks("p1")
    assert held > 0
    fleet["p1"] = replace(fleet["p1"], generation=1.0)
    prefix.sync(fleet.values(), clock.monotonic())
    assert prefix.index.index_blocks("p1") == held
    fleet["p1"] = replace(fleet["p1"], generation=2.0)  # then a restart
    prefix.sync(fleet.values(), clock.monotonic())
    assert prefix.index.index_blocks("p1") == 0


def test_an_engine_removed_from_the_fleet_is_forgotten() -> None:
    clock = FakeClock()
    prefix = PrefixPlacement(CONFIG, clock)
    fleet = states()
    prefix.sync(fleet.values(), clock.monotonic())
    placed_on(prefix, "p1")
    del fleet["p1"]
    prefix.sync(fleet.values(), clock.monotonic())
    assert "p1" not in prefix.engines()


def test_least_loaded_computes_no_keys() -> None:
    config = CONFIG.model_copy(
        update={"placement": CONFIG.placement.model_copy(update={"policy": "least_loaded"})}
    )
    prefix = PrefixPlacement(config, FakeClock())
    assert prefix.prompt_now(parse_request("completions", _body(PROMPT), "m"), "m") is None


def test_discovered_engines_publish_on_the_configured_ports_of_their_host() -> None:
    endpoint = events_of(CONFIG.engines[1], CONFIG.placement)
    assert endpoint is not None
    assert endpoint.endpoint == "tcp://10.0.0.2:5557"
    assert endpoint.replay_endpoint is None
    for url, host in (
        ("http://[fd00::2]:8000", "[fd00::2]"),  # IPv6, bracketed as ZMQ writes it
        ("http://[fd00::2]/", "[fd00::2]"),
        ("https://engine-2.ns.svc", "engine-2.ns.svc"),  # no port
    ):
        engine = CONFIG.engines[1].model_copy(update={"url": url})
        found = events_of(engine, CONFIG.placement)
        assert found is not None and found.endpoint == f"tcp://{host}:5557", url


def test_a_model_without_a_tokenizer_is_named_at_start(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="narwhal.placement"):
        PrefixPlacement(CONFIG, FakeClock())
    assert [r.getMessage().split(":")[1].strip() for r in caplog.records] == [
        "model m has no placement.tokenizers entry"
    ]
    # Without events to key (no engine publishes), the same news is a detail: placement by
    # text blocks is what the default (`prefix`) does for every model without a tokenizer.
    raw = CONFIG.model_dump(mode="json")
    raw["placement"]["kv_events_port"] = None
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="narwhal.placement"):
        PrefixPlacement(parse_config(raw), FakeClock())
    assert [r.levelno for r in caplog.records] == [logging.DEBUG]


def test_an_engine_s_reported_cache_size_bounds_its_approximate_entries() -> None:
    """vLLM's `cache_config_info` (num_gpu_blocks x block_size, read by the load scrape) sizes
    the LRU of what Narwhal placed on an engine, unless `engines[].kv_capacity_tokens` is set."""
    raw = CONFIG.model_dump(mode="json")
    raw["engines"][0]["kv_capacity_tokens"] = 1 << 20
    config = parse_config(raw)
    clock = FakeClock()
    prefix = PrefixPlacement(config, clock)
    prefix.sync(
        [EngineState(config=e, role=e.role, generation=1.0) for e in config.engines],
        clock.monotonic(),
    )
    small = EngineLoad(0, 0, 0.0, at=0.0, capacity_tokens=4 * 16)
    prefix.set_loads({"p0": small, "p1": small})
    for engine in ("p0", "p1"):
        placed_on(prefix, engine)
    # Its 4 most recent blocks (one entry each, read as approximate and as speculative).
    assert prefix.index.index_blocks("p1") == 4
    assert prefix.index.index_blocks("p0") > 4  # configured: the scrape does not override


def test_a_prefill_s_keys_are_told_to_the_other_processes_when_new_to_them() -> None:
    """Telling costs a frame to the control process and to each other worker: a prompt
    placed again on the same engine is told again only once the others' speculative entry
    has lived a quarter of its life, so a hot prefix costs no frame per request."""
    clock = FakeClock()
    told: list[tuple[str, str, int]] = []
    prefix = PrefixPlacement(CONFIG, clock, share=lambda m, e, keys: told.append((m, e, len(keys))))
    prefix.sync(states().values(), clock.monotonic())
    retell_s = prefix.index.config.speculative_ttl_s * RETELL_SHARE
    placed_on(prefix, "p1")
    placed_on(prefix, "p1")
    assert len(told) == 1 and told[0][:2] == ("m", "p1") and told[0][2] > 0
    placed_on(prefix, "p0")  # the same keys, new to another engine
    other = parse_request("completions", _body("another prompt " * 30), "m")
    other_prompt = prefix.prompt_now(other, "m")
    assert other_prompt is not None
    prefix.placed(other_prompt, "p1", 0)  # new keys on the same engine
    assert [e for _, e, _ in told] == ["p1", "p0", "p1"]
    clock.advance(retell_s * 0.9)
    placed_on(prefix, "p1")
    assert len(told) == 3
    clock.advance(retell_s * 0.1)
    placed_on(prefix, "p1")
    assert len(told) == 4, "told again: the others' entries stay fresh"
    prefix.placed(other_prompt, "d0", 0, prefill=False)
    assert len(told) == 4, "a decode's pick is never told"
    clock.advance(retell_s)
    prefix.sync(states().values(), clock.monotonic())
    assert prefix._told == {}, "what the others have forgotten by now is dropped"


def test_a_prefix_is_told_again_once_its_engine_was_emptied() -> None:
    clock = FakeClock()
    told: list[str] = []
    prefix = PrefixPlacement(CONFIG, clock, share=lambda m, e, keys: told.append(e))
    fleet = states()
    prefix.sync(fleet.values(), clock.monotonic())
    placed_on(prefix, "p1")
    fleet["p1"] = replace(fleet["p1"], generation=2.0)  # restarted: every process empties it
    prefix.sync(fleet.values(), clock.monotonic())
    placed_on(prefix, "p1")
    assert told == ["p1", "p1"]


def test_the_explanation_of_a_unified_model_names_its_engine_for_both_legs() -> None:
    """`POST /admin/placement`'s shape (DESIGN §11) for `role: both` engines: the one
    ranking under `prefill` and `decode` alike, the engine that prefills decoding too."""
    config = parse_config(
        {
            "model": "m",
            "engines": [
                {"id": "u0", "url": "http://10.0.0.1:8000", "role": "both"},
                {"id": "u1", "url": "http://10.0.0.2:8000", "role": "both"},
            ],
        }
    )
    clock = FakeClock()
    prefix = PrefixPlacement(config, clock)
    fleet = Fleet(config.engines, clock)
    for engine in ("u0", "u1"):
        fleet.apply(Readmitted(engine, "test"), 0.0)
    prefix.sync([fleet.get("u0"), fleet.get("u1")], 0.0)
    req = parse_request("completions", _body(PROMPT + "x"), "m")
    view = prefix.explain(req, "m", fleet, clock.monotonic())
    assert [r["id"] for r in view["prefill"]] == ["u0", "u1"]
    assert view["decode"] == view["prefill"]
    assert view["chosen"] == {"prefill": "u0", "decode": "u0"}


def test_a_prompt_given_as_a_list_of_one_text_is_placed_as_that_text() -> None:
    """`"prompt": ["text"]` is one prompt (the API accepts it): keyed as the text, where its
    one string was once taken for token ids and refused by the key hash."""
    clock = FakeClock()
    prefix = PrefixPlacement(CONFIG, clock)
    prefix.sync(states().values(), clock.monotonic())
    as_text = prefix.prompt_now(parse_request("completions", _body(PROMPT), "m"), "m")
    listed = b'{"model": "m", "prompt": ["%s"], "max_tokens": 1}' % PROMPT.encode()
    as_list = prefix.prompt_now(parse_request("completions", listed, "m"), "m")
    assert as_text is not None and as_text.keys and as_list == as_text


def test_token_ids_no_engine_has_are_placed_by_load_not_refused_here() -> None:
    """A negative id, or one past 32 bits, cannot be keyed: placed by load (None), and the
    engine answers the request with its own 400."""
    clock = FakeClock()
    prefix = PrefixPlacement(CONFIG, clock)
    prefix.sync(states().values(), clock.monotonic())
    for ids in (b"[-1, 5]", b"[%d]" % (1 << 40)):
        body = b'{"model": "m", "prompt": %s, "max_tokens": 1}' % ids
        assert prefix.prompt_now(parse_request("completions", body, "m"), "m") is None


def test_a_lora_adapter_is_keyed_under_its_name_on_its_engines_model() -> None:
    """vLLM keys an adapter's blocks by its name: a request for the adapter is matched in
    its engines' model's index with keys rooted at the adapter's name, so the base model's
    same prompt matches none of the adapter's placements (and the other way round)."""
    clock = FakeClock()
    prefix = PrefixPlacement(CONFIG, clock)
    fleet = {k: replace(e, adapters=frozenset({"m-sql"})) for k, e in states().items()}
    prefix.sync(fleet.values(), clock.monotonic())
    ids = list(range(1, 65))
    body = b'{"model": "m-sql", "prompt": %s, "max_tokens": 1}' % str(ids).encode()
    adapter = prefix.prompt_now(parse_request("completions", body, "m-sql"), "m-sql")
    assert adapter is not None
    assert adapter.model == "m"
    assert adapter.keys == tuple(prompt_keys(ids, 16, lora_name="m-sql"))
    base_body = body.replace(b'"m-sql"', b'"m"')
    base = prefix.prompt_now(parse_request("completions", base_body, "m"), "m")
    assert base is not None and base.keys == tuple(prompt_keys(ids, 16))
    prefix.placed(adapter, "p1", 0)
    assert prefix.match(adapter)["p1"].matched_tokens == 64
    assert "p1" not in prefix.match(base)
    # An engine that no longer lists the adapter: the name is a model of its own (no index).
    prefix.sync(states().values(), clock.monotonic())
    alone = prefix.prompt_now(parse_request("completions", body, "m-sql"), "m-sql")
    assert alone is not None and alone.model == "m-sql" and alone.keys == ()
