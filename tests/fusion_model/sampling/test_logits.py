"""Logits processing: the guidance algebra, top-k / top-p sets, draws that follow the distribution, the penalty."""

from __future__ import annotations

import torch

from fusion_model.sampling import apply_repetition_penalty, choose_tokens, mix_guidance, truncate_logits


def test_three_stream_mix_reduces_to_two_stream_when_both_scales_are_equal():
    torch.manual_seed(0)
    full, img, uncond = torch.randn(3, 4, 50).unbind(0)
    for s in (1.0, 1.5, 3.0):
        torch.testing.assert_close(mix_guidance(full, uncond, s, img, s), mix_guidance(full, uncond, s))
    # image scale 1 and text scale s: guidance relative to the image-only stream
    torch.testing.assert_close(mix_guidance(full, uncond, 1.0, img, 2.5), mix_guidance(full, img, 2.5))
    assert torch.equal(mix_guidance(full, uncond, 1.0), full)


def test_top_k_and_top_p_keep_the_documented_sets_per_row():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05], [0.1, 0.2, 0.3, 0.4]]))
    out = truncate_logits(logits, torch.tensor([2, 0, 0]), torch.tensor([1.0, 0.8, 0.75]))
    kept = torch.isfinite(out)
    assert kept.tolist() == [[True, True, False, False], [True, True, False, False], [False, True, True, True]]
    torch.testing.assert_close(out[kept], logits[kept])
    assert torch.isfinite(truncate_logits(logits, torch.tensor([0, 0, 0]), torch.tensor([1e-6] * 3))).sum() == 3
    top_k_only = truncate_logits(logits, torch.tensor([2, 0, 1]), torch.ones(3))  # the partial top-k path
    assert torch.isfinite(top_k_only).sum(dim=1).tolist() == [2, 4, 1]
    assert int(top_k_only[2].argmax()) == 3


def test_sampling_draws_from_the_distribution():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05, 0.0]]).log().repeat(20000, 1)
    draws = choose_tokens(logits, torch.ones(20000), torch.Generator().manual_seed(0))
    frequencies = torch.bincount(draws, minlength=5) / 20000
    torch.testing.assert_close(frequencies, torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0]), atol=0.015, rtol=0)
    hot = choose_tokens(logits[:3], torch.tensor([0.0, 1e-3, 1.0]), torch.Generator().manual_seed(0))
    assert hot[:2].tolist() == [0, 0]  # temperature 0 is argmax, a tiny temperature almost so


def test_repetition_penalty_pushes_seen_tokens_down():
    logits = torch.tensor([[2.0, -2.0, 1.0]])
    seen = torch.tensor([[True, True, False]])
    assert apply_repetition_penalty(logits, seen, 2.0).tolist() == [[1.0, -4.0, 1.0]]
