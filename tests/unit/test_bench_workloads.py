"""The `cache` suite's workloads (bench.loadgen.workloads): deterministic, and sharing exactly
what each says it shares."""

from __future__ import annotations

import itertools

import pytest
from bench.loadgen.workloads import Workload


def _take(w: Workload, n: int) -> list[list[str]]:
    return list(itertools.islice(w.sessions(), n))


def test_the_same_workload_sends_the_same_prompts_and_another_round_other_ones() -> None:
    w = Workload("multi_turn", system_words=20, question_words=4, turns=3, answer_words=5)
    assert _take(w, 5) == _take(w, 5)
    other = _take(Workload(**{**w.to_json(), "round": 1}), 5)
    assert not set(map(tuple, other)) & set(map(tuple, _take(w, 5)))
    assert Workload.from_json(w.to_json()) == w


def test_shared_prefix_sessions_are_one_of_the_groups_system_prompts_and_a_question() -> None:
    w = Workload("shared_prefix", groups=3, system_words=50, question_words=5)
    sessions = _take(w, 60)
    assert all(len(s) == 1 for s in sessions)
    words = [s[0].split() for s in sessions]
    assert all(len(p) == 55 for p in words)
    systems = {tuple(p[:50]) for p in words}
    assert len(systems) == 3  # every group drawn, and only those
    assert len({tuple(p) for p in words}) == 60  # no whole prompt repeats
    # the next round keeps the system prompts and changes the questions
    again = _take(Workload(**{**w.to_json(), "round": 1}), 60)
    assert {tuple(s[0].split()[:50]) for s in again} == systems
    assert w.prompt_tokens() == 55


def test_each_turn_of_a_conversation_extends_the_previous_one() -> None:
    w = Workload("multi_turn", system_words=30, question_words=4, turns=4, answer_words=6)
    for session in _take(w, 10):
        assert len(session) == 4
        for before, after in itertools.pairwise(session):
            assert after.startswith(before + " ")
            assert len(after.split()) == len(before.split()) + 10
        assert len(session[-1].split()) == w.prompt_tokens()
    firsts = [s[0].split()[:30] for s in _take(w, 10)]
    assert len({tuple(f) for f in firsts}) == 10  # conversations share nothing


def test_no_sharing_prompts_share_no_block() -> None:
    w = Workload("no_sharing", system_words=60, question_words=4)
    heads = {tuple(s[0].split()[:16]) for s in _take(w, 200)}
    assert len(heads) == 200


def test_an_unknown_kind_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown workload 'rag'"):
        Workload("rag")
