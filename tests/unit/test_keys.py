from __future__ import annotations

import pytest

from kvfabric.keys import KEY_SIZE, ROOT_KEY, chain_key, chain_keys, fold_key, namespace_bytes


def test_chain_key_is_deterministic_and_32_bytes() -> None:
    a = chain_key(ROOT_KEY, [1, 2, 3])
    assert a == chain_key(ROOT_KEY, [1, 2, 3])
    assert len(a) == KEY_SIZE


def test_chain_key_names_the_whole_prefix() -> None:
    first = chain_key(ROOT_KEY, [1, 2])
    other_first = chain_key(ROOT_KEY, [9, 9])
    assert chain_key(first, [3, 4]) != chain_key(other_first, [3, 4])


def test_namespace_and_tokens_cannot_be_confused_by_concatenation() -> None:
    # Without length framing, b"ab"+tokens and b"a"+b"b"+tokens would hash the same bytes.
    assert chain_key(ROOT_KEY, b"bcd", b"a") != chain_key(ROOT_KEY, b"cd", b"ab")
    assert chain_key(ROOT_KEY, [1], b"model-a") != chain_key(ROOT_KEY, [1], b"model-b")


def test_chain_keys_chunks_and_chains() -> None:
    tokens = list(range(1000))
    keys = chain_keys(tokens, 256)
    assert len(keys) == 4
    assert keys[1] == chain_key(keys[0], tokens[256:512])
    assert chain_keys(tokens, 256, full_only=True) == keys[:3]
    # Equal prefixes give equal keys whatever follows.
    assert chain_keys(tokens[:512] + [7] * 300, 256)[:2] == keys[:2]


def test_chain_key_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="32 bytes"):
        chain_key(b"short", [1])
    with pytest.raises(ValueError, match="token ids"):
        chain_key(ROOT_KEY, [2**40])
    with pytest.raises(ValueError, match="chunk_size"):
        chain_keys([1], 0)


def test_fold_key_separates_namespaces_and_hash_types() -> None:
    h = 0x1234_5678_9ABC
    assert fold_key(h, b"ns") == fold_key(h, b"ns")
    assert fold_key(h, b"ns") != fold_key(h, b"other")
    assert fold_key(h, ["llama", "bf16"]) != fold_key(h, ["llamab", "f16"])
    assert fold_key(-1, b"") == fold_key(2**64 - 1, b"")
    assert len(fold_key(b"\x00" * 64, b"")) == KEY_SIZE
    assert fold_key("abc", b"") == fold_key(b"abc", b"")


def test_namespace_parts_are_length_framed() -> None:
    assert namespace_bytes(["ab", "c"]) != namespace_bytes(["a", "bc"])
    assert namespace_bytes(b"raw") == b"raw"
