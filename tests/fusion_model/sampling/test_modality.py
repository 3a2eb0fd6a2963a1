"""Chameleon's modality rules, never violated (a property test), and the text the repetition penalty has seen."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fusion_model.sampling import SamplingConfig, generate_ids
from tokenizer.vocab import train_unified_vocab

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sampling_helpers import CORPUS, greedy, prompts_of, steer, tiny_model  # noqa: E402


@pytest.fixture(scope="module")
def vocab():
    return train_unified_vocab(CORPUS, vocab_size=320, image_codes=16, num_specials=16)


# ---------------------------------------------------------------- modality rules (property test)


def check_rules(prompt: list[int], new: list[int], vocab, grid, mode: str, context: int, max_new: int | None) -> None:
    """An independent reading of Chameleon's rules, token by token."""
    n_codes = grid[0] * grid[1]
    inside, codes = False, 0
    for t in prompt:  # a prompt may end inside an image
        if t == vocab.boi_id:
            inside, codes = True, 0
        elif t == vocab.eoi_id:
            inside = False
        elif inside:
            codes += 1
    images = 0
    assert len(prompt) + len(new) <= context
    if max_new is not None:
        assert len(new) <= max_new
    for i, t in enumerate(new):
        if inside:
            if codes < n_codes:
                assert bool(vocab.is_image(torch.tensor(t))), f"step {i}: non-image id {t} inside an image"
                codes += 1
            else:
                assert t == vocab.eoi_id, f"step {i}: {n_codes} codes done but {t} instead of <eoi>"
                inside, images = False, images + 1
        elif t == vocab.boi_id:
            assert mode != "text", f"step {i}: <boi> in text mode"
            assert len(prompt) + i + n_codes + 2 <= context, f"step {i}: <boi> although the image cannot fit"
            if max_new is not None:
                assert i + n_codes + 2 <= max_new
            inside, codes = True, 0
        else:
            assert mode != "image", f"step {i}: {t} in image mode outside an image"
            assert t in (vocab.eos_id, vocab.sep_id) or bool(vocab.is_text(torch.tensor(t))), f"step {i}: id {t} in text mode"
    assert not inside, "an image was left unfinished"
    if mode == "image":
        assert images == 1 and new[-1] == vocab.eoi_id


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(0, 2**16),
    mode=st.sampled_from(["text", "image", "interleaved"]),
    grid=st.tuples(st.integers(1, 3), st.integers(1, 3)),
    context=st.integers(16, 48),
    strength=st.floats(0.0, 12.0),
    prompt_text=st.lists(st.integers(0, 200), min_size=0, max_size=8),
    open_image=st.sampled_from([-1, -1, -1, 0, 1, 2]),  # -1: none; k: the prompt ends inside an image after k codes
    max_new=st.one_of(st.none(), st.integers(1, 30)),
    temperature=st.sampled_from([0.0, 0.7, 1.0, 2.0]),
    top_k=st.sampled_from([0, 1, 5]),
    top_p=st.sampled_from([1.0, 0.9, 0.3]),
    guidance=st.sampled_from(["none", "two", "three"]),
)
def test_modality_rules_are_never_violated(
    vocab, seed, mode, grid, context, strength, prompt_text, open_image, max_new, temperature, top_k, top_p, guidance
):
    generator = torch.Generator().manual_seed(seed)
    model = steer(tiny_model(vocab, seed=seed, context=context), vocab, strength, generator)
    text_ids = torch.nonzero(vocab.is_text(torch.arange(vocab.vocab_size))).flatten()
    prompt = [vocab.bos_id] + [int(text_ids[i % len(text_ids)]) for i in prompt_text]
    n_codes = grid[0] * grid[1]
    open_image = min(open_image, n_codes - 1)
    if open_image >= 0:
        prompt += [vocab.boi_id] + [vocab.image_offset + 1] * open_image
    cfg = {"none": {}, "two": {"cfg_scale": 3.0}, "three": {"cfg_image_scale": 1.2, "cfg_text_scale": 3.0}}[guidance]
    config = SamplingConfig(
        mode=mode, image_grid=grid, max_new_tokens=max_new, seed=seed, repetition_penalty=1.3,
        text_temperature=temperature, image_temperature=temperature, text_top_k=top_k, image_top_k=top_k,
        text_top_p=top_p, image_top_p=top_p, **cfg,
    )
    # new tokens the request needs for sure: the rest of an opened image, or in image mode a whole one
    needed = n_codes - open_image + 1 if open_image >= 0 else (n_codes + 2 if mode == "image" else 0)
    impossible = (
        len(prompt) >= context
        or (mode == "text" and open_image >= 0)
        or len(prompt) + needed > context
        or (max_new is not None and max_new < needed)
    )
    if impossible:  # the sampler must refuse with an error, never emit a broken sequence
        with pytest.raises(ValueError):
            generate_ids(model, vocab, [prompt], config)
        return
    (new,) = generate_ids(model, vocab, [prompt], config)
    check_rules(prompt, new, vocab, grid, mode, context, max_new)


def test_a_long_unconditional_prompt_limits_room_for_images_too(vocab):
    model = steer(tiny_model(vocab, context=24), vocab, 6.0, torch.Generator().manual_seed(6))
    prompt = [vocab.bos_id, vocab.encode_text("the")[0]]
    uncond = [vocab.bos_id] + vocab.encode_text("one two three four five six seven")[:13]  # 14 tokens
    config = SamplingConfig(mode="interleaved", image_grid=(2, 2), seed=0, cfg_scale=2.0)
    for seed in range(5):
        (new,) = generate_ids(model, vocab, [prompt], replace(config, seed=seed), uncond_prompts=[uncond])
        # the unconditional row is 12 tokens longer, so the effective context is 12 shorter
        check_rules(prompt, new, vocab, (2, 2), "interleaved", 24 - (len(uncond) - len(prompt)), None)


# ---------------------------------------------------------------- the repetition penalty's memory of text


def test_repetition_penalty_changes_greedy_text(vocab):
    model = tiny_model(vocab)
    plain = generate_ids(model, vocab, prompts_of(vocab)[:1], greedy(mode="text", max_new_tokens=40))
    penalized = generate_ids(model, vocab, prompts_of(vocab)[:1], greedy(mode="text", max_new_tokens=40, repetition_penalty=50.0))
    assert len(set(penalized[0])) == len(penalized[0])  # a huge penalty forbids every repeat
    assert plain != penalized
