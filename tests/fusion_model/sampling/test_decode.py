"""generate_ids: KV cache == recomputation, batching, seeds, stopping, and requests it refuses with what to do."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from fusion_model.sampling import SamplingConfig, generate_ids
from tokenizer.vocab import train_unified_vocab

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sampling_helpers import CORPUS, greedy, prompts_of, steer, tiny_model  # noqa: E402


@pytest.fixture(scope="module")
def vocab():
    return train_unified_vocab(CORPUS, vocab_size=320, image_codes=16, num_specials=16)


# ---------------------------------------------------------------- cache, batching, seeds


@pytest.mark.parametrize("mode", ["text", "image", "interleaved"])
def test_cached_greedy_equals_recomputation_token_for_token(vocab, mode):
    model = tiny_model(vocab)
    steer(model, vocab, 4.25, torch.Generator().manual_seed(1))  # so interleaved output mixes text and images
    config = greedy(mode=mode, image_grid=(2, 2), max_new_tokens=None if mode == "image" else 40, cfg_scale=2.0)
    cached = generate_ids(model, vocab, prompts_of(vocab), config)
    recomputed = generate_ids(model, vocab, prompts_of(vocab), replace(config, use_kv_cache=False))
    assert cached == recomputed
    assert all(len(row) > 0 for row in cached)
    if mode == "interleaved":
        assert all(vocab.boi_id in row and bool(vocab.is_text(torch.tensor(row)).any()) for row in cached)


def test_a_prompt_gives_the_same_greedy_output_alone_and_in_a_batch(vocab):
    model = tiny_model(vocab)
    config = greedy(mode="text", max_new_tokens=20)
    batched = generate_ids(model, vocab, prompts_of(vocab), config)
    alone = [generate_ids(model, vocab, [p], config)[0] for p in prompts_of(vocab)]
    assert batched == alone


def test_the_same_seed_gives_the_same_samples_and_another_seed_others(vocab):
    model = tiny_model(vocab)
    config = SamplingConfig(mode="interleaved", image_grid=(2, 2), max_new_tokens=30, seed=7)
    first = generate_ids(model, vocab, prompts_of(vocab), config)
    again = generate_ids(model, vocab, prompts_of(vocab), config)
    other = generate_ids(model, vocab, prompts_of(vocab), replace(config, seed=8))
    assert first == again
    assert first != other


def test_generation_stops_at_eos_and_within_max_new_tokens(vocab):
    model = steer(tiny_model(vocab), vocab, 0.0, torch.Generator().manual_seed(0))
    with torch.no_grad():
        model.head.bias[vocab.eos_id] += 50.0  # the model wants to stop at once
    out = generate_ids(model, vocab, prompts_of(vocab), greedy(mode="text", max_new_tokens=5))
    assert out == [[vocab.eos_id]] * 3
    keep_going = generate_ids(model, vocab, prompts_of(vocab), greedy(mode="text", max_new_tokens=5, stop_at_eos=False))
    assert [len(row) for row in keep_going] == [5, 5, 5]


# ---------------------------------------------------------------- bad input


def test_bad_requests_are_refused_with_what_to_do(vocab):
    model = tiny_model(vocab, context=16)
    long_prompt = [vocab.bos_id] + [vocab.eos_id + 100] * 20
    with pytest.raises(ValueError, match="context is 16.*shorten the prompt"):
        generate_ids(model, vocab, [long_prompt], SamplingConfig(mode="text"))
    with pytest.raises(ValueError, match="cannot|only .* fit"):
        generate_ids(model, vocab, [[vocab.bos_id]], SamplingConfig(mode="image", image_grid=(4, 4)))
    with pytest.raises(ValueError, match="max_new_tokens=3"):
        generate_ids(model, vocab, [[vocab.bos_id]], SamplingConfig(mode="image", image_grid=(2, 2), max_new_tokens=3))
    with pytest.raises(ValueError, match="image_grid"):
        generate_ids(model, vocab, [[vocab.bos_id]], SamplingConfig(mode="image"))
    other = tiny_model(vocab, vocab_size=vocab.vocab_size + 64)
    with pytest.raises(ValueError, match="vocab_size 384 but the vocabulary has 320"):
        generate_ids(other, vocab, [[vocab.bos_id]], SamplingConfig(mode="text"))
    shifted = tiny_model(vocab, image_offset=vocab.image_offset + 1)
    with pytest.raises(ValueError, match="image_offset"):
        generate_ids(shifted, vocab, [[vocab.bos_id]], SamplingConfig(mode="text"))
    with pytest.raises(ValueError, match="mode"):
        SamplingConfig(mode="audio")
    with pytest.raises(ValueError, match="cfg_text_scale"):
        SamplingConfig(cfg_image_scale=1.2)
