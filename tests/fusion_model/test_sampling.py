"""The sampler: KV cache == recomputation, Chameleon's modality rules, guidance algebra, seeds, outputs."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from fusion_model.generation import generate
from fusion_model.sample_output import write_samples
from fusion_model.sampling import (
    SamplingConfig,
    apply_repetition_penalty,
    choose_tokens,
    generate_ids,
    image_only_prompt,
    mix_guidance,
    truncate_logits,
)
from tokenizer.image import ImageTokenizer, ImageTokenizerConfig
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


def test_a_long_unconditional_prompt_limits_room_for_images_too(vocab):
    model = steer(tiny_model(vocab, context=24), vocab, 6.0, torch.Generator().manual_seed(6))
    prompt = [vocab.bos_id, vocab.encode_text("the")[0]]
    uncond = [vocab.bos_id] + vocab.encode_text("one two three four five six seven")[:13]  # 14 tokens
    config = SamplingConfig(mode="interleaved", image_grid=(2, 2), seed=0, cfg_scale=2.0)
    for seed in range(5):
        (new,) = generate_ids(model, vocab, [prompt], replace(config, seed=seed), uncond_prompts=[uncond])
        # the unconditional row is 12 tokens longer, so the effective context is 12 shorter
        check_rules(prompt, new, vocab, (2, 2), "interleaved", 24 - (len(uncond) - len(prompt)), None)


def test_three_stream_mix_reduces_to_two_stream_when_both_scales_are_equal():
    torch.manual_seed(0)
    full, img, uncond = torch.randn(3, 4, 50).unbind(0)
    for s in (1.0, 1.5, 3.0):
        torch.testing.assert_close(mix_guidance(full, uncond, s, img, s), mix_guidance(full, uncond, s))
    # image scale 1 and text scale s: guidance relative to the image-only stream
    torch.testing.assert_close(mix_guidance(full, uncond, 1.0, img, 2.5), mix_guidance(full, img, 2.5))
    assert torch.equal(mix_guidance(full, uncond, 1.0), full)


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


# ---------------------------------------------------------------- logits processing


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


def test_repetition_penalty_changes_greedy_text(vocab):
    model = tiny_model(vocab)
    plain = generate_ids(model, vocab, prompts_of(vocab)[:1], greedy(mode="text", max_new_tokens=40))
    penalized = generate_ids(model, vocab, prompts_of(vocab)[:1], greedy(mode="text", max_new_tokens=40, repetition_penalty=50.0))
    assert len(set(penalized[0])) == len(penalized[0])  # a huge penalty forbids every repeat
    assert plain != penalized


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
        SamplingConfig(mode="video")
    with pytest.raises(ValueError, match="cfg_text_scale"):
        SamplingConfig(cfg_image_scale=1.2)


# ---------------------------------------------------------------- images in and out


def image_tokenizer_of(codes: int) -> ImageTokenizer:
    """A random tiny VQ image tokenizer: 8 px images, 2x2 codes."""
    torch.manual_seed(0)
    config = ImageTokenizerConfig(image_size=8, base_channels=8, channel_multiplier=(1, 1, 1), num_res_blocks=1,
                                  latent_channels=8, norm_groups=4, codebook_size=codes)
    return ImageTokenizer(config).eval()


def test_generate_decodes_images_to_the_configured_size_and_writes_png_json_html(vocab, tmp_path):
    model = steer(tiny_model(vocab), vocab, 2.0, torch.Generator().manual_seed(5))
    image_tokenizer = image_tokenizer_of(vocab.image_codes)
    photo = tmp_path / "prompt.png"
    Image.new("RGB", (12, 8), (200, 10, 10)).save(photo)
    prompts = [["the cat"], ["a dog", photo, "sat"]]
    config = SamplingConfig(mode="image", seed=0)
    samples = generate(model, vocab, image_tokenizer, prompts, config)
    for segments in samples:
        (image,) = segments
        assert isinstance(image, Image.Image) and image.size == (8, 8)
    paths = write_samples(tmp_path / "out", samples, prompts=prompts, ids=[[1, 2], [3]], settings={"seed": 0})
    body = json.loads(paths["json"].read_text())
    assert [r["ids"] for r in body["samples"]] == [[1, 2], [3]]
    first_png = tmp_path / "out" / body["samples"][0]["output"][0]["image"]
    with Image.open(first_png) as png:
        assert png.size == (8, 8)
    assert body["samples"][1]["prompt"][1]["source"] == str(photo)
    page = paths["html"].read_text()
    assert page.count("data:image/png;base64,") == 3 and "a dog" in page and "src=\"http" not in page


def test_generate_explains_missing_or_unreadable_prompt_images(vocab, tmp_path):
    model = tiny_model(vocab)
    image_tokenizer = image_tokenizer_of(vocab.image_codes)
    config = SamplingConfig(mode="text", max_new_tokens=3)
    with pytest.raises(FileNotFoundError, match="nothere.png"):
        generate(model, vocab, image_tokenizer, [["a", tmp_path / "nothere.png"]], config)
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"not a png")
    with pytest.raises(ValueError, match="broken.png"):
        generate(model, vocab, image_tokenizer, [[broken]], config)
    with pytest.raises(ValueError, match="16 image ids"):
        generate(model, vocab, image_tokenizer_of(32), [["a"]], config)
