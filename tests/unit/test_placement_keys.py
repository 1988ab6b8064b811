"""Narwhal's block keys: chained, prefix-faithful, deterministic across processes."""

from __future__ import annotations

import subprocess
import sys

import pytest

from narwhal.placement.keys import InvalidTokens, chain_keys, prompt_keys, root_key

TOKENS = list(range(100, 164))  # 4 blocks of 16


def test_only_full_blocks_are_keyed() -> None:
    assert len(prompt_keys(TOKENS, 16)) == 4
    assert len(prompt_keys(TOKENS[:63], 16)) == 3
    assert prompt_keys(TOKENS[:15], 16) == []
    assert prompt_keys([], 16) == []


def test_a_key_stands_for_the_whole_prefix() -> None:
    base = prompt_keys(TOKENS, 16)
    changed_last = prompt_keys([*TOKENS[:-1], 7], 16)
    assert changed_last[:3] == base[:3] and changed_last[3] != base[3]
    changed_first = prompt_keys([7, *TOKENS[1:]], 16)
    assert all(a != b for a, b in zip(changed_first, base, strict=True))
    # The same block after a different prefix gets a different key.
    assert prompt_keys(TOKENS[16:32], 16)[0] != base[1]


def test_extra_keys_separate_adapters_and_salts() -> None:
    plain = prompt_keys(TOKENS, 16)
    lora = prompt_keys(TOKENS, 16, lora_name="sql")
    salted = prompt_keys(TOKENS, 16, cache_salt="tenant-a")
    other_salt = prompt_keys(TOKENS, 16, cache_salt="tenant-b")
    assert len({plain[0], lora[0], salted[0], other_salt[0]}) == 4
    assert all(a != b for a, b in zip(plain, salted, strict=True))


def test_chaining_from_a_parent_continues_the_prompt() -> None:
    whole = prompt_keys(TOKENS, 16)
    tail = chain_keys(whole[1], TOKENS[32:], 16)
    assert tail == whole[2:]
    assert chain_keys(root_key(None), TOKENS, 16) == whole


def test_salt_enters_the_first_block_only_as_an_extra_key() -> None:
    salted = prompt_keys(TOKENS, 16, cache_salt="s")
    by_extras = chain_keys(root_key(None), TOKENS, 16, [("s",), None, None, None])
    assert salted == by_extras


def test_keys_are_64_bit_and_deterministic_across_processes() -> None:
    here = prompt_keys(TOKENS, 16, lora_name="a", cache_salt="b")
    assert all(0 <= k < 2**64 for k in here)
    code = (
        "from narwhal.placement.keys import prompt_keys;"
        f"print(prompt_keys({TOKENS!r}, 16, lora_name='a', cache_salt='b'))"
    )
    env = {"PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
    )
    assert out.stdout.strip() == repr(here)


@pytest.mark.parametrize("tokens", [[-1] * 16, [2**32] * 16, ["a"] * 16])
def test_invalid_tokens_are_a_typed_error(tokens: list[object]) -> None:
    with pytest.raises(InvalidTokens):
        prompt_keys(tokens, 16)  # type: ignore[arg-type]


def test_block_size_below_one_is_refused() -> None:
    with pytest.raises(InvalidTokens):
        prompt_keys(TOKENS, 0)
