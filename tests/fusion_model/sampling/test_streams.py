"""The guidance streams: scale 1 is plain sampling, three streams reduce to two, the image-only prompt."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from fusion_model.sampling import SamplingConfig, generate_ids, image_only_prompt
from tokenizer.vocab import train_unified_vocab

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sampling_helpers import CORPUS, greedy, prompts_of, steer, tiny_model  # noqa: E402


@pytest.fixture(scope="module")
def vocab():
    return train_unified_vocab(CORPUS, vocab_size=320, image_codes=16, num_specials=16)


# ---------------------------------------------------------------- guidance


def test_guidance_scale_one_equals_plain_conditional_sampling(vocab):
    model = steer(tiny_model(vocab), vocab, 3.0, torch.Generator().manual_seed(2))
    plain = SamplingConfig(mode="interleaved", image_grid=(2, 2), max_new_tokens=30, seed=3)
    unconditional = [[vocab.bos_id]] * 3
    guided = generate_ids(model, vocab, prompts_of(vocab), plain, uncond_prompts=unconditional)
    assert guided == generate_ids(model, vocab, prompts_of(vocab), plain)
    # the unconditional stream really is in the batch: another scale changes the images (the steered model's codes
    # are peaked, so 12 codes of one seed may coincide; three seeds may not)
    images = [replace(plain, mode="image", seed=seed) for seed in (3, 4, 5)]
    assert any(generate_ids(model, vocab, prompts_of(vocab), replace(image, cfg_scale=5.0))
               != generate_ids(model, vocab, prompts_of(vocab), image) for image in images)


def test_three_stream_sampling_equals_two_stream_sampling_when_scales_make_it_so(vocab):
    model = steer(tiny_model(vocab), vocab, 3.0, torch.Generator().manual_seed(4))
    base = greedy(mode="image", image_grid=(3, 3))
    two = generate_ids(model, vocab, prompts_of(vocab), replace(base, cfg_scale=2.0))
    three = generate_ids(
        model, vocab, prompts_of(vocab),
        replace(base, cfg_image_scale=2.0, cfg_text_scale=2.0),
    )
    assert two == three


def test_the_image_conditional_stream_keeps_only_the_prompt_images(vocab):
    grid = torch.tensor([[1, 2], [3, 4]])
    prompt = vocab.encode_document(["the cat", grid, "sat on"], eos=False)
    start = prompt.index(vocab.boi_id)
    assert image_only_prompt(prompt, vocab) == [vocab.bos_id] + prompt[start : start + 6]
    assert image_only_prompt(vocab.encode_document(["the cat"], eos=False), vocab) == [vocab.bos_id]
