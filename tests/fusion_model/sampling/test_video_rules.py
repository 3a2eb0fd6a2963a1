"""Video clips in the sampler: mode "video", `<bov>` / `<eov>` under the modality rules (a property test), prompts
that end inside a clip, guidance and temperature on clip codes, the compiled and speculative steps."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fusion_model.sampling import SamplingConfig, generate_ids, image_only_prompt
from tokenizer.vocab import train_unified_vocab

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sampling_helpers import CORPUS, greedy, steer, tiny_model  # noqa: E402


@pytest.fixture(scope="module")
def vocab():
    return train_unified_vocab(CORPUS, vocab_size=320, image_codes=16, num_specials=16, video=True)


@pytest.fixture(scope="module")
def plain_vocab():
    return train_unified_vocab(CORPUS, vocab_size=320, image_codes=16, num_specials=16)


def steer_video(model, vocab, strength: float, generator: torch.Generator):
    """sampling_helpers.steer, and pushed towards `<bov>` / `<eov>` as well."""
    model = steer(model, vocab, strength, generator)
    with torch.no_grad():
        model.head.bias[vocab.bov_id] += strength
        model.head.bias[vocab.eov_id] += strength
    return model


def check_rules(prompt, new, vocab, grid, video_grid, mode, context, max_new) -> None:
    """An independent reading of the rules with clips, token by token."""
    sizes = {"image": grid[0] * grid[1], "video": video_grid[0] * video_grid[1] * video_grid[2]}
    closers = {"image": vocab.eoi_id, "video": vocab.eov_id}
    kind, codes = None, 0
    for t in prompt:  # a prompt may end inside an image or a clip
        if t in (vocab.boi_id, vocab.bov_id):
            kind, codes = ("image" if t == vocab.boi_id else "video"), 0
        elif kind is not None and t == closers[kind]:
            kind = None
        elif kind is not None:
            codes += 1
    spans: list[str] = []
    assert len(prompt) + len(new) <= context
    if max_new is not None:
        assert len(new) <= max_new
    for i, t in enumerate(new):
        if kind is not None:
            if codes < sizes[kind]:
                assert bool(vocab.is_image(torch.tensor(t))), f"step {i}: non-code id {t} inside a {kind}"
                codes += 1
            else:
                assert t == closers[kind], f"step {i}: {sizes[kind]} codes done but {t} ends the {kind}"
                spans.append(kind)
                kind = None
        elif t in (vocab.boi_id, vocab.bov_id):
            kind, codes = ("image" if t == vocab.boi_id else "video"), 0
            assert mode in ("interleaved", kind if kind == "video" else "image"), f"step {i}: a {kind} in mode {mode}"
            assert len(prompt) + i + sizes[kind] + 2 <= context, f"step {i}: a {kind} opened that cannot fit"
            if max_new is not None:
                assert i + sizes[kind] + 2 <= max_new
        else:
            assert mode not in ("image", "video"), f"step {i}: {t} in mode {mode} outside its span"
            assert t in (vocab.eos_id, vocab.sep_id) or bool(vocab.is_text(torch.tensor(t))), f"step {i}: id {t}"
    assert kind is None, "a span was left unfinished"
    if mode in ("image", "video"):
        assert len(spans) == 1 and new[-1] == closers[spans[0]]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(0, 2**16),
    mode=st.sampled_from(["text", "image", "interleaved", "interleaved", "video"]),
    grid=st.tuples(st.integers(1, 2), st.integers(1, 2)),
    video_grid=st.tuples(st.integers(1, 3), st.integers(1, 2), st.integers(1, 2)),
    context=st.integers(12, 48),
    strength=st.floats(0.0, 12.0),
    prompt_text=st.lists(st.integers(0, 200), min_size=0, max_size=6),
    open_span=st.sampled_from([None, None, ("image", 0), ("image", 1), ("video", 0), ("video", 2), ("video", 5)]),
    max_new=st.one_of(st.none(), st.integers(1, 30)),
    temperature=st.sampled_from([0.0, 0.7, 1.0]),
    top_p=st.sampled_from([1.0, 0.5]),
    guidance=st.sampled_from(["none", "two", "three"]),
)
def test_rules_with_clips_are_never_violated(
    vocab, seed, mode, grid, video_grid, context, strength, prompt_text, open_span, max_new, temperature, top_p,
    guidance,
):
    generator = torch.Generator().manual_seed(seed)
    model = steer_video(tiny_model(vocab, seed=seed % 4, context=context), vocab, strength, generator)
    text_ids = torch.nonzero(vocab.is_text(torch.arange(vocab.vocab_size))).flatten()
    prompt = [vocab.bos_id] + [int(text_ids[i % len(text_ids)]) for i in prompt_text]
    sizes = {"image": grid[0] * grid[1], "video": video_grid[0] * video_grid[1] * video_grid[2]}
    needed = {"image": sizes["image"] + 2, "video": sizes["video"] + 2}.get(mode, 0)
    wrong_mode = False
    if open_span is not None:
        kind, done = open_span[0], min(open_span[1], sizes[open_span[0]] - 1)
        prompt += [vocab.boi_id if kind == "image" else vocab.bov_id] + [vocab.image_offset + 1] * done
        needed = sizes[kind] - done + 1
        wrong_mode = mode == "text" or (mode in ("image", "video") and mode != kind)
    cfg = {"none": {}, "two": {"cfg_scale": 3.0}, "three": {"cfg_image_scale": 1.2, "cfg_text_scale": 3.0}}[guidance]
    config = SamplingConfig(
        mode=mode, image_grid=grid, video_grid=video_grid, max_new_tokens=max_new, seed=seed,
        text_temperature=temperature, image_temperature=temperature, text_top_p=top_p, image_top_p=top_p, **cfg,
    )
    impossible = (len(prompt) >= context or wrong_mode or len(prompt) + needed > context
                  or (max_new is not None and max_new < needed))
    if impossible:  # the sampler must refuse with an error, never emit a broken sequence
        with pytest.raises(ValueError):
            generate_ids(model, vocab, [prompt], config)
        return
    (new,) = generate_ids(model, vocab, [prompt], config)
    check_rules(prompt, new, vocab, grid, video_grid, mode, context, max_new)


@pytest.mark.parametrize("use_kv_cache", [True, False])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_video_mode_makes_exactly_one_clip(vocab, use_kv_cache, temperature):
    model = steer_video(tiny_model(vocab), vocab, 8.0, torch.Generator().manual_seed(1))
    prompts = [vocab.encode_document(["the cat"], eos=False), [vocab.bos_id]]
    config = SamplingConfig(mode="video", video_grid=(2, 2, 3), seed=3, use_kv_cache=use_kv_cache,
                            text_temperature=temperature, image_temperature=temperature, cfg_scale=2.0)
    for new in generate_ids(model, vocab, prompts, config):
        assert len(new) == 2 + 12 and new[0] == vocab.bov_id and new[-1] == vocab.eov_id
        assert bool(vocab.is_image(torch.tensor(new[1:-1])).all())
        (clip,) = vocab.decode_document(new, video_grid=(2, 2, 3))
        assert clip.shape == (2, 2, 3)


def test_interleaved_never_opens_a_clip_that_cannot_fit(vocab):
    # pushed hard towards <bov>: with room for images but not for a 3x2x2 clip, none is opened
    model = steer_video(tiny_model(vocab, context=16), vocab, 12.0, torch.Generator().manual_seed(2))
    with torch.no_grad():
        model.head.bias[vocab.bov_id] += 30.0
    config = SamplingConfig(mode="interleaved", image_grid=(1, 2), video_grid=(4, 2, 2), seed=0)
    for seed in range(4):
        (new,) = generate_ids(model, vocab, [[vocab.bos_id]], replace(config, seed=seed))
        assert vocab.bov_id not in new
    # with the room, the same model opens one (and finishes it)
    (new,) = generate_ids(model, vocab, [[vocab.bos_id]], replace(config, video_grid=(1, 2, 2)))
    assert vocab.bov_id in new
    check_rules([vocab.bos_id], new, vocab, (1, 2), (1, 2, 2), "interleaved", 16, None)
    # no video_grid: clips are never opened
    (new,) = generate_ids(model, vocab, [[vocab.bos_id]], replace(config, video_grid=None))
    assert vocab.bov_id not in new


def test_a_prompt_ending_inside_a_clip_is_finished_first(vocab):
    model = steer_video(tiny_model(vocab), vocab, 6.0, torch.Generator().manual_seed(3))
    prompt = vocab.encode_document(["a dog"], eos=False) + [vocab.bov_id] + [vocab.image_offset + 2] * 5
    for mode in ("interleaved", "video"):
        config = SamplingConfig(mode=mode, image_grid=(2, 2), video_grid=(2, 2, 2), seed=1)
        (new,) = generate_ids(model, vocab, [prompt], config)
        assert bool(vocab.is_image(torch.tensor(new[:3])).all()) and new[3] == vocab.eov_id
        if mode == "video":
            assert len(new) == 4  # the clip it was in is the one clip
        segments = vocab.decode_document(prompt + new, video_grid=(2, 2, 2))
        assert segments[1].shape == (2, 2, 2) and segments[1].reshape(-1)[:5].tolist() == [2] * 5
    with pytest.raises(ValueError, match="inside a clip.*mode is 'text'"):
        generate_ids(model, vocab, [prompt], SamplingConfig(mode="text", video_grid=(2, 2, 2)))
    with pytest.raises(ValueError, match="inside a clip.*mode is 'image'"):
        generate_ids(model, vocab, [prompt], SamplingConfig(mode="image", image_grid=(2, 2), video_grid=(2, 2, 2)))
    with pytest.raises(ValueError, match="more than t·h·w = 4"):
        generate_ids(model, vocab, [prompt], SamplingConfig(mode="interleaved", image_grid=(2, 2),
                                                            video_grid=(1, 2, 2)))


def test_video_needs_a_grid_and_markers(vocab, plain_vocab):
    model = tiny_model(vocab)
    with pytest.raises(ValueError, match=r"video_grid \(t, h, w\) is needed"):
        generate_ids(model, vocab, [[vocab.bos_id]], SamplingConfig(mode="video"))
    with pytest.raises(ValueError, match=r"no video markers|has none.*train\.py vocab --video"):
        generate_ids(tiny_model(plain_vocab), plain_vocab, [[plain_vocab.bos_id]],
                     SamplingConfig(mode="video", video_grid=(1, 1, 1)))
    with pytest.raises(ValueError, match="the clip needs 14 more tokens"):
        generate_ids(model, vocab, [[vocab.bos_id]], SamplingConfig(mode="video", video_grid=(3, 2, 2),
                                                                    max_new_tokens=None),
                     uncond_prompts=[[vocab.bos_id] * 55])
    with pytest.raises(ValueError, match="video_grid"):
        SamplingConfig(video_grid=(2, 0, 2))
    with pytest.raises(ValueError, match="3 whole numbers"):
        SamplingConfig(video_grid=(2, 2))
    # interleaved on a vocabulary without markers: video_grid is harmless, clips are never opened
    (new,) = generate_ids(tiny_model(plain_vocab), plain_vocab, [[plain_vocab.bos_id]],
                          SamplingConfig(image_grid=(1, 1), video_grid=(1, 1, 1), seed=0, max_new_tokens=20))
    assert 7 not in new


def test_clip_codes_take_the_image_temperature_and_guidance(vocab):
    model = steer_video(tiny_model(vocab), vocab, 4.0, torch.Generator().manual_seed(4))
    prompt = [vocab.encode_document(["one two"], eos=False)]
    base = SamplingConfig(mode="video", video_grid=(2, 2, 2), image_temperature=0.0, text_temperature=5.0)
    # image temperature 0: every seed gives the same clip (the text temperature never counts)
    clips = {tuple(generate_ids(model, vocab, prompt, replace(base, seed=s))[0]) for s in range(3)}
    assert len(clips) == 1
    # guidance applies inside clips: the greedy clip is the argmax of the guided logits
    guided = generate_ids(model, vocab, prompt, replace(base, cfg_scale=4.0))[0]
    plain = next(iter(clips))
    assert list(plain) != guided
    ids = prompt[0] + [vocab.bov_id]
    for code in guided[1:-1]:
        with torch.no_grad():
            cond = model(torch.tensor([ids]))[0, -1].float()
            uncond = model(torch.tensor([[vocab.bos_id] + ids[len(prompt[0]):]]))[0, -1].float()
        mixed = cond + 3.0 * (cond - uncond)
        mixed[~vocab.is_image(torch.arange(vocab.vocab_size))] = float("-inf")
        assert int(mixed.argmax()) == code
        ids.append(code)


@pytest.mark.parametrize("window", [2, 4])
def test_speculative_decoding_inside_clips_gives_the_greedy_clip(vocab, window):
    model = steer_video(tiny_model(vocab), vocab, 6.0, torch.Generator().manual_seed(5))
    prompts = [vocab.encode_document(["the cat"], eos=False),
               [vocab.bos_id, vocab.bov_id, vocab.image_offset + 3]]
    for mode in ("video", "interleaved"):
        config = greedy(mode=mode, image_grid=(2, 2), video_grid=(2, 2, 2), max_new_tokens=24)
        stats: dict = {}
        fast = generate_ids(model, vocab, prompts, replace(config, speculative_window=window), stats=stats)
        assert fast == generate_ids(model, vocab, prompts, config)


def test_speculative_sampling_inside_clips_keeps_the_rules(vocab):
    model = steer_video(tiny_model(vocab), vocab, 6.0, torch.Generator().manual_seed(8))
    prompt = vocab.encode_document(["the cat"], eos=False)
    for mode in ("video", "interleaved"):
        config = SamplingConfig(mode=mode, image_grid=(2, 2), video_grid=(2, 2, 2), max_new_tokens=30, seed=4,
                                speculative_window=3, cfg_scale=2.0)
        (new,) = generate_ids(model, vocab, [prompt], config)
        check_rules(prompt, new, vocab, (2, 2), (2, 2, 2), mode, 64, 30)


def test_the_image_conditional_stream_keeps_clips(vocab):
    clip = torch.zeros(1, 1, 2, dtype=torch.long)
    prompt = vocab.encode_document(["a", clip, "b", torch.zeros(1, 1, dtype=torch.long), "c"], eos=False)
    prompt += [vocab.bov_id, vocab.image_offset]
    assert image_only_prompt(prompt, vocab) == [vocab.bos_id, vocab.bov_id, *[vocab.image_offset] * 2, vocab.eov_id,
                                                vocab.boi_id, vocab.image_offset, vocab.eoi_id, vocab.bov_id,
                                                vocab.image_offset]


def test_compiled_step_samples_the_same_clip(vocab):
    model = steer_video(tiny_model(vocab), vocab, 6.0, torch.Generator().manual_seed(6))
    prompts = [vocab.encode_document(["a dog"], eos=False), [vocab.bos_id]]
    config = SamplingConfig(mode="interleaved", image_grid=(1, 2), video_grid=(2, 1, 2), seed=7, max_new_tokens=30)
    eager = generate_ids(model, vocab, prompts, config)
    assert eager == generate_ids(model, vocab, prompts, replace(config, compile=True))
