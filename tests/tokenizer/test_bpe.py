"""Byte-level BPE training: the 256 byte tokens always exist, merges come in rank order, reserved names are pruned."""

from __future__ import annotations

import pytest

from tokenizer.bpe import BYTE_ALPHABET, BpeResult, prune_tokens, train_bpe

CORPUS = ["the cat sat on the mat", "the dog sat on the log", "then the cat ran"] * 10


def test_byte_alphabet_covers_every_byte_once():
    assert len(BYTE_ALPHABET) == 256 == len(set(BYTE_ALPHABET))


def test_tokens_are_bytes_then_merge_results_in_rank_order():
    result = train_bpe(CORPUS, vocab_size=300)
    assert result.tokens[:256] == BYTE_ALPHABET
    assert result.tokens[256:] == [a + b for a, b in result.merges]
    assert len(result.tokens) <= 300 and len(set(result.tokens)) == len(result.tokens)
    assert "Ġthe" in result.tokens  # the most frequent word (with its leading space) became one token
    assert result.texts_seen == len(CORPUS) and result.chars_seen == sum(map(len, CORPUS))


def test_training_stops_early_on_a_tiny_corpus():
    result = train_bpe(["ab ab ab"], vocab_size=10_000)
    assert 256 < len(result.tokens) < 300


def test_min_frequency_limits_merges():
    rare = train_bpe(CORPUS + ["zyxw"], vocab_size=400, min_frequency=1)
    common = train_bpe(CORPUS + ["zyxw"], vocab_size=400, min_frequency=11)
    assert "zyxw" in rare.tokens and "zyxw" not in common.tokens
    assert len(common.merges) < len(rare.merges)


def test_prune_drops_forbidden_tokens_and_everything_built_on_them():
    result = BpeResult(
        tokens=BYTE_ALPHABET + ["ab", "abc", "cd", "abcd"],
        merges=[("a", "b"), ("ab", "c"), ("c", "d"), ("ab", "cd")],
        texts_seen=1,
        chars_seen=4,
    )
    pruned = prune_tokens(result, lambda token: token == "ab")
    assert pruned.merges == [("c", "d")]
    assert pruned.tokens == BYTE_ALPHABET + ["cd"]


def test_bad_input():
    with pytest.raises(ValueError, match="corpus is empty"):
        train_bpe(iter([]), vocab_size=300)
    with pytest.raises(TypeError, match="corpus item 1 is a bytes"):
        train_bpe(["ok", b"bytes"], vocab_size=300)
    with pytest.raises(ValueError, match="at least 256 tokens"):
        train_bpe(CORPUS, vocab_size=100)
