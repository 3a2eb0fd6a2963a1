"""Speculative Jacobi decoding: greedy ids equal the plain sampler's, sampled images follow its exact distribution,
fewer forwards when codes are predictable, and KVCache.truncate rolls back exactly."""

from __future__ import annotations

import itertools
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import fusion_model.sampling.speculative as speculative  # the SJD step looks its rules up in this module
from fusion_model.sampling import (
    SamplingConfig,
    build_streams,
    generate_ids,
    mix_guidance,
    truncate_logits,
)
from tokenizer.vocab import train_unified_vocab

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sampling_helpers import CORPUS, greedy, prompts_of, steer, tiny_model  # noqa: E402

GUIDANCE = {"none": {}, "two": {"cfg_scale": 2.0}, "three": {"cfg_image_scale": 1.2, "cfg_text_scale": 3.0}}


@pytest.fixture(scope="module")
def vocab():
    return train_unified_vocab(CORPUS, vocab_size=320, image_codes=16, num_specials=16)


@pytest.fixture(scope="module")
def few_codes_vocab():
    """Three image codes, so every image of a small grid can be enumerated."""
    return train_unified_vocab(CORPUS, vocab_size=320, image_codes=3, num_specials=16)


def run(model, vocab, prompts, config) -> tuple[list[list[int]], dict]:
    stats: dict = {}
    return generate_ids(model, vocab, prompts, config, stats=stats), stats


# ---------------------------------------------------------------- greedy: token for token


@pytest.mark.parametrize("guidance", sorted(GUIDANCE))
@pytest.mark.parametrize("mode", ["image", "interleaved"])
def test_greedy_speculative_decoding_gives_the_plain_greedy_ids(vocab, mode, guidance):
    model = steer(tiny_model(vocab, context=96), vocab, 4.25, torch.Generator().manual_seed(1))
    config = greedy(mode=mode, image_grid=(4, 4), max_new_tokens=None if mode == "image" else 60, **GUIDANCE[guidance])
    prompts = prompts_of(vocab)[:2]
    plain, plain_stats = run(model, vocab, prompts, config)
    assert plain_stats["image_tokens"] >= 16  # an image was made, so the speculative path ran
    for window in (2, 4, 8):
        fast, stats = run(model, vocab, prompts, replace(config, speculative_window=window))
        assert fast == plain, f"window {window}"
        assert stats["image_tokens"] == plain_stats["image_tokens"]
        assert stats["forwards"] <= plain_stats["forwards"]
    recomputed, _ = run(model, vocab, prompts, replace(config, speculative_window=4, use_kv_cache=False))
    assert recomputed == plain


def test_text_is_sampled_exactly_as_the_plain_sampler_does_for_a_seed(vocab):
    model = tiny_model(vocab)
    config = SamplingConfig(mode="text", max_new_tokens=20, seed=5, repetition_penalty=1.3)
    assert run(model, vocab, prompts_of(vocab), replace(config, speculative_window=4))[0] == run(
        model, vocab, prompts_of(vocab), config
    )[0]


def test_seeded_speculative_sampling_is_reproducible(vocab):
    model = steer(tiny_model(vocab), vocab, 4.25, torch.Generator().manual_seed(1))
    config = SamplingConfig(mode="interleaved", image_grid=(3, 3), max_new_tokens=40, seed=7, speculative_window=4)
    first, _ = run(model, vocab, prompts_of(vocab), config)
    assert first == run(model, vocab, prompts_of(vocab), config)[0]
    assert first != run(model, vocab, prompts_of(vocab), replace(config, seed=8))[0]


# ---------------------------------------------------------------- sampling: the exact distribution


def exact_image_distribution(model, vocab, prompt, config) -> tuple[torch.Tensor, torch.Tensor]:
    """Every image of config.image_grid (codes (n, h·w)) and its probability under the plain sampler's rules.

    Recomputed from whole sequences without a cache: guidance, image ids only, top-k / top-p, temperature.
    """
    n_codes = config.image_grid[0] * config.image_grid[1]
    images = torch.tensor(list(itertools.product(range(vocab.image_codes), repeat=n_codes)))
    codes = images + vocab.image_offset
    streams = build_streams(vocab, [prompt], config, model.config.max_seq_len)
    logits = []
    for row in streams.rows:
        ids = torch.cat([torch.tensor(row + [vocab.boi_id]).expand(len(codes), -1), codes], dim=1)
        logits.append(model(ids)[:, len(row) : len(row) + n_codes])  # from <boi> on: the logits of each code
    if len(logits) == 1:
        mixed = logits[0]
    elif len(logits) == 2:
        mixed = mix_guidance(logits[0], logits[1], config.cfg_scale)
    else:
        mixed = mix_guidance(logits[0], logits[1], config.cfg_image_scale, logits[2], config.cfg_text_scale)
    flat = mixed.reshape(-1, mixed.shape[-1])
    flat = flat.masked_fill(~vocab.is_image(torch.arange(flat.shape[-1])), float("-inf"))
    rows = len(flat)
    flat = truncate_logits(flat, torch.full((rows,), config.image_top_k), torch.full((rows,), config.image_top_p))
    probs = (flat / config.image_temperature).softmax(dim=-1).view(len(codes), n_codes, -1)
    return images, probs.gather(-1, codes[..., None]).squeeze(-1).double().prod(dim=-1)


def chi_square_p_value(samples: list[list[int]], vocab, images: torch.Tensor, probability: torch.Tensor) -> float:
    """Pearson's test of the sampled images against their exact probabilities (bins under 5 expected pooled)."""
    index = {tuple(image): i for i, image in enumerate(images.tolist())}
    counts = torch.zeros(len(images), dtype=torch.float64)
    for ids in samples:
        assert ids[0] == vocab.boi_id and ids[-1] == vocab.eoi_id
        counts[index[tuple(t - vocab.image_offset for t in ids[1:-1])]] += 1
    expected = probability / probability.sum() * counts.sum()
    if counts[expected == 0].sum() > 0:  # an image the plain sampler can never make
        return 0.0
    big = expected >= 5
    observed = torch.cat([counts[big], counts[~big].sum()[None]])
    expected = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = expected > 0
    statistic = ((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    degrees = torch.tensor(float(keep.sum() - 1), dtype=torch.float64)
    return float(torch.special.gammaincc(degrees / 2, statistic / 2))  # the chi-square survival function


# a random model with large weights: its code distributions are spread over the codes yet depend on the codes before
SAMPLED = {
    "plain": dict(speculative_window=0),
    "window 2": dict(speculative_window=2),
    "window 4, two streams, top-k": dict(speculative_window=4, cfg_scale=2.0, image_top_k=2),
    "window 3, three streams, top-p, temperature 1.2": dict(
        speculative_window=3, cfg_image_scale=1.1, cfg_text_scale=1.3, image_top_p=0.95, image_temperature=1.2
    ),
}


def sampled_images(few_codes_vocab, overrides, n_samples=4000) -> tuple[float, torch.Tensor]:
    model = tiny_model(few_codes_vocab, context=16, init_std=0.6)
    prompt = few_codes_vocab.encode_document(["the cat"], eos=False)
    config = SamplingConfig(mode="image", image_grid=(1, 5), seed=0, **overrides)
    with torch.no_grad():
        images, probability = exact_image_distribution(model, few_codes_vocab, prompt, config)
    # one batch of identical prompts: its rows are independent samples, each committing its own codes per forward
    samples, stats = run(model, few_codes_vocab, [prompt] * n_samples, config)
    return chi_square_p_value(samples, few_codes_vocab, images, probability), probability


@pytest.mark.parametrize("name", sorted(SAMPLED))
def test_sampled_images_follow_the_plain_samplers_exact_distribution(few_codes_vocab, name):
    p_value, probability = sampled_images(few_codes_vocab, SAMPLED[name])
    assert int((probability * 4000 >= 5).sum()) >= 8, "too few images are likely for the test to have power"
    assert p_value > 1e-3, f"{name}: chi-square p = {p_value:.2e}"


def accept_every_draft(target, drafts, draft_q, window, uniform, noise):
    rows = torch.arange(len(window))
    return window.clone(), speculative.draw_from_weights(target[rows, window], noise)


def replace_from_p(target, drafts, draft_q, window, uniform, noise):
    accepted, _ = correct_verify(target, drafts, draft_q, window, uniform, noise)
    rows = torch.arange(len(window))
    return accepted, speculative.draw_from_weights(target[rows, accepted], noise)


correct_verify = speculative._verify
correct_coupling = speculative.coupled_drafts


def keep_every_old_draft(new_q, old_drafts, old_q, has_old, uniform, noise):
    """The old draft stays even where the new proposal gives it less mass: the drafts no longer follow q_new."""
    return torch.where(has_old, old_drafts, correct_coupling(new_q, old_drafts, old_q, has_old, uniform, noise))


@pytest.mark.parametrize("name, wrong_rule", [("_verify", accept_every_draft), ("_verify", replace_from_p),
                                              ("coupled_drafts", keep_every_old_draft)])
def test_the_distribution_test_catches_a_biased_acceptance_rule(few_codes_vocab, monkeypatch, name, wrong_rule):
    monkeypatch.setattr(speculative, name, wrong_rule)
    p_value, _ = sampled_images(few_codes_vocab, SAMPLED["window 2"])
    assert p_value < 1e-6


# ---------------------------------------------------------------- forward passes


def test_predictable_codes_take_one_forward_per_window(vocab):
    model = steer(tiny_model(vocab), vocab, 0.0, torch.Generator().manual_seed(0))
    with torch.no_grad():
        model.head.bias[vocab.image_offset + 5] += 40.0  # code 5 wins whatever came before
    prompts = prompts_of(vocab)[:2]
    for temperature in (0.0, 1.0):
        config = SamplingConfig(mode="image", image_grid=(4, 4), image_temperature=temperature, seed=0)
        plain, plain_stats = run(model, vocab, prompts, config)
        # <boi> is forced, so it joins the prompt; then a forward per code (the prefill's included); <eoi> is forced
        assert plain_stats == {"forwards": 16, "image_tokens": 32}
        for window in (2, 4, 8):
            fast, stats = run(model, vocab, prompts, replace(config, speculative_window=window))
            assert fast == plain
            # the prefill draws the first code and drafts the next ones; then window + 1 codes per forward
            assert stats == {"forwards": 1 + -(-15 // (window + 1)), "image_tokens": 32}


@pytest.mark.parametrize("mode", ["image", "interleaved"])
def test_never_more_forwards_than_the_longest_output(vocab, mode):
    model = steer(tiny_model(vocab, context=96), vocab, 4.25, torch.Generator().manual_seed(2))
    for seed, window in itertools.product(range(3), (2, 4, 8)):
        config = SamplingConfig(mode=mode, image_grid=(4, 4), max_new_tokens=None if mode == "image" else 60,
                                seed=seed, cfg_scale=2.0, speculative_window=window)
        out, stats = run(model, vocab, prompts_of(vocab), config)
        # every forward commits at least one token for every unfinished prompt (the plain sampler: exactly one)
        assert stats["forwards"] <= max(len(row) for row in out)


# ---------------------------------------------------------------- the KV cache


def test_truncating_the_cache_and_feeding_again_equals_never_feeding_the_dropped_tokens(vocab):
    model = tiny_model(vocab)
    prompt = torch.tensor([vocab.encode_document(["the cat sat"], eos=False)] * 2)
    rejected = torch.tensor([[vocab.image_offset + 1, vocab.image_offset + 2, vocab.image_offset + 3]] * 2)
    accepted = torch.tensor([[vocab.image_offset + 4, vocab.image_offset + 5]] * 2)
    with torch.no_grad():
        clean = model.new_kv_cache(2, 32)
        model(prompt, kv_cache=clean)
        expected = model(accepted, kv_cache=clean)
        rolled_back = model.new_kv_cache(2, 32)
        model(prompt, kv_cache=rolled_back)
        model(torch.cat([accepted[:, :1], rejected], dim=1), kv_cache=rolled_back)
        rolled_back.truncate(prompt.shape[1] + 1)  # keep the first accepted token, drop the three rejected ones
        got = model(accepted[:, 1:], kv_cache=rolled_back)
    torch.testing.assert_close(got, expected[:, 1:])
    assert rolled_back.length == clean.length
    with pytest.raises(ValueError, match="outside"):
        rolled_back.truncate(rolled_back.length + 1)


# ---------------------------------------------------------------- bad input


def test_bad_speculative_settings_are_refused(vocab):
    for window in (1, -1):
        with pytest.raises(ValueError, match="speculative_window"):
            SamplingConfig(speculative_window=window)
    with pytest.raises(ValueError, match="needs the KV cache"):
        SamplingConfig(use_kv_cache=False, compile=True)
    model = tiny_model(vocab, image_bidirectional=True)
    with pytest.raises(ValueError, match="image_bidirectional"):
        generate_ids(model, vocab, [[vocab.bos_id]], SamplingConfig(mode="image", image_grid=(2, 2), speculative_window=2))
