"""The placement decision: prefill by the work waited for and done, decode by load and cache
with an imbalance guard, rotation."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from narwhal.placement.score import Load, rank


def ids(ranked: list) -> list[str]:
    return [r.id for r in ranked]


def test_the_engine_holding_the_prefix_wins_at_equal_load() -> None:
    engines = [Load("a", 1), Load("b", 1), Load("c", 1)]
    ranked = rank(engines, {"b": 960}, prompt_tokens=1000, turn=0)
    assert ids(ranked)[0] == "b"
    assert ranked[0].matched_tokens == 960


def test_a_longer_prefix_beats_a_shorter_one() -> None:
    engines = [Load("a", 0), Load("b", 0)]
    assert ids(rank(engines, {"a": 200, "b": 800}, 1000, 0))[0] == "b"


def test_a_small_extra_load_does_not_move_a_long_prefix() -> None:
    engines = [Load("a", 3), Load("b", 2)]
    assert ids(rank(engines, {"a": 900}, 1000, 0))[0] == "a"


def test_without_matches_the_least_loaded_wins_by_the_engine_s_own_count() -> None:
    engines = [Load("a", 1, held=6), Load("b", 2, held=0), Load("c", 4)]
    assert ids(rank(engines, {}, 100, 0)) == ["b", "c", "a"]


def test_an_engine_s_queue_is_the_larger_of_its_own_count_and_narwhal_s_legs() -> None:
    """The engine's running + waiting already holds Narwhal's legs on it: the two are not
    added. Its count covers other routers; Narwhal's covers what the scrape has not seen."""
    assert Load("mine", 10, held=10).queue == 10  # all ten are Narwhal's, counted once
    assert Load("shared", 3, held=12).queue == 12  # nine from elsewhere
    assert Load("ahead", 8, held=2).queue == 8  # six sent since the last scrape
    assert Load("stale", 5).queue == 5
    engines = [Load("mine", 10, held=10), Load("shared", 3, held=12)]
    assert ids(rank(engines, {}, 100, 0)) == ["mine", "shared"]


def test_a_prefix_wins_until_its_queue_costs_more_than_computing_the_prompt_elsewhere() -> None:
    """cost = queue x (tokens per request + 16) + 2 x uncached tokens: 6 cached requests
    ahead (40 tokens each) cost less than 1,000 tokens of prefill on the idle engine; 60 do
    not."""

    def hot(queue: int) -> list[Load]:
        return [Load("hot", queue, tokens_per_request=40), Load("cold", 1, tokens_per_request=1000)]

    assert ids(rank(hot(6), {"hot": 960}, 1000, 0))[0] == "hot"
    assert ids(rank(hot(60), {"hot": 960}, 1000, 0))[0] == "cold"
    # the score is the cost over the prompt, negated: 6 x 56 + 2 x 40 = 416 tokens
    assert rank(hot(6), {"hot": 960}, 1000, 0)[0].score == -0.416


def test_a_burst_of_one_new_prefix_waits_for_its_first_prefill() -> None:
    """One full prefill ahead (unknown history: like this prompt) on the engine that will hold
    the prefix: waiting for it beats computing the prompt again on an idle engine."""
    engines = [Load("first", 1, tokens_per_request=1000), Load("idle", 0)]
    assert ids(rank(engines, {"first": 992}, 1000, 0))[0] == "first"


def test_without_history_an_engine_s_queue_is_taken_for_requests_like_this_one() -> None:
    """Unknown tokens per request: the queue holding the prefix is of cheap requests, the
    other engine's of full prompts."""
    engines = [Load("hot", 20), Load("cold", 1)]
    assert ids(rank(engines, {"hot": 960}, 1000, 0))[0] == "hot"  # 20 x 56 + 80 < 1016 + 2000
    assert ids(rank([Load("hot", 60), Load("cold", 1)], {"hot": 960}, 1000, 0))[0] == "cold"


def test_the_decode_imbalance_guard_ignores_the_cache_of_a_swamped_decode() -> None:
    engines = [Load("hot", 20), Load("cold", 1)]
    ranked = rank(engines, {"hot": 1000}, 1000, 0, decode=True)
    assert ids(ranked)[0] == "cold"
    # Below the absolute threshold the cache still decides.
    engines = [Load("hot", 6), Load("cold", 1)]
    assert ids(rank(engines, {"hot": 1000}, 1000, 0, decode=True))[0] == "hot"


def test_a_busy_engine_does_not_take_the_other_engines_cache_credit() -> None:
    """Only the busy engine's own cost grows: a request whose prefix is on a lightly loaded
    engine still goes there, not to the least loaded one."""
    engines = [Load("hot", 40), Load("warm", 3), Load("idle", 1)]
    assert ids(rank(engines, {"warm": 900}, 1000, 0))[0] == "warm"
    # and the hot engine's own prefix goes to the lightest engine holding it, else the idle one
    assert ids(rank(engines, {"hot": 900, "warm": 900}, 1000, 0))[0] == "warm"
    assert ids(rank(engines, {"hot": 900}, 1000, 0))[0] == "idle"


def test_decode_counts_kv_usage_against_an_engine() -> None:
    engines = [Load("full", 0, kv_usage=0.9), Load("room", 0, kv_usage=0.1)]
    assert ids(rank(engines, {}, 100, 0, decode=True))[0] == "room"
    # Prefill ignores it: ties go by rotation.
    assert ids(rank(engines, {}, 100, 0))[0] == "full"


def test_ties_rotate_with_the_turn() -> None:
    engines = [Load("a", 0), Load("b", 0), Load("c", 0)]
    firsts = [ids(rank(engines, {}, 10, turn))[0] for turn in range(6)]
    assert firsts == ["a", "b", "c", "a", "b", "c"]


def test_a_match_longer_than_the_prompt_counts_as_the_whole_prompt() -> None:
    (only,) = rank([Load("a", 0)], {"a": 5000}, 100, 0)
    assert only.matched_tokens == 100


def test_no_candidates_no_decision() -> None:
    assert rank([], {"a": 10}, 10, 0) == []


@given(
    st.lists(st.tuples(st.integers(0, 50), st.integers(0, 2000)), min_size=1, max_size=6),
    st.integers(1, 2000),
    st.integers(0, 100),
)
def test_every_candidate_is_ranked_once_and_never_one_outside(
    rows: list[tuple[int, int]], prompt: int, turn: int
) -> None:
    engines = [Load(f"e{i}", load) for i, (load, _) in enumerate(rows)]
    matched = {f"e{i}": hit for i, (_, hit) in enumerate(rows)}
    ranked = rank(engines, matched, prompt, turn)
    assert sorted(ids(ranked)) == sorted(e.id for e in engines)
    assert [r.score for r in ranked] == sorted((r.score for r in ranked), reverse=True)
