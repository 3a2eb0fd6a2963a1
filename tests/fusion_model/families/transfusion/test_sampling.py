"""Sampling a Transfusion checkpoint (fusion_model.families.transfusion.sampling): an oracle denoiser's image comes
back through generate, guidance scale 1 is the conditional branch alone and scale s mixes it with the image-alone
branch, the KV-cached path gives the full recompute's ids and latents (several prompts opening images at different
steps), the text prefix is computed once and the clean image written into the cache once, and `train.py generate`
writes PNG, JSON and HTML from a tiny transfusion checkpoint."""

from __future__ import annotations

import json

import pytest
import torch

from fusion_model import cli
from fusion_model.config import FusionConfig
from fusion_model.families.transfusion import sampling as ts
from fusion_model.families.transfusion.diffusion import guided_noise
from fusion_model.families.transfusion.family import TransfusionFamily
from fusion_model.families.transfusion.sampling import DiffusionSamplingConfig
from fusion_model.sampling import SamplingConfig
from fusion_model.sampling import step as step_module  # the decode loop's token choice
from tokenizer.image import ContinuousImageTokenizer, ImageTokenizer, ImageTokenizerConfig, to_pil
from tokenizer.layout import patchify, unpatchify

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: one torch thread, restored after

C, K = 4, 2  # latent channels, patch size: a 4x4 latent grid is P = 4 patches of D = 16 values
D = C * K * K
# 16 px images, downsampling 4: 4x4 latents of 4 channels
TINY_KL = ImageTokenizerConfig(image_size=16, base_channels=8, channel_multiplier=(1, 1, 1), num_res_blocks=1,
                               latent_channels=8, norm_groups=4, bottleneck="kl", embed_dim=C)


@pytest.fixture(scope="module")
def files(tiny_tokenizers):
    """The shared tiny vocabulary, VQ bundle and photo (tests/fusion_model/conftest.py), and a continuous bundle
    `kl/` (4x4 latents of 4 channels)."""
    torch.manual_seed(3)
    ContinuousImageTokenizer(TINY_KL).save_pretrained(tiny_tokenizers / "kl")
    return tiny_tokenizers


@pytest.fixture(scope="module")
def vocab(files):
    from tokenizer.vocab import UnifiedVocab

    return UnifiedVocab.load(files / "tokenizer.json")


@pytest.fixture(scope="module")
def kl(files):
    return ContinuousImageTokenizer.from_pretrained(files / "kl")


def family_config(vocab) -> FusionConfig:
    return FusionConfig.from_preset("tiny", vocab_size=320, image_offset=vocab.image_offset, image_codes=16,
                                    max_seq_len=64)


def family_options(vocab) -> dict:
    # no clamp of the clean estimate: this untrained model's estimates would all sit at the clamp, hiding the
    # guidance and cache differences these tests look for (the clamp has its own test in test_diffusion.py)
    return {"latent_channels": C, "patch_size": K, "image_placeholder_id": vocab.image_placeholder_id,
            "x0_clip": None}


def built(vocab, seed: int = 0) -> tuple[TransfusionFamily, dict]:
    family = TransfusionFamily(family_config(vocab), family_options(vocab))
    torch.manual_seed(seed)
    parts = family.build()
    for part in parts.values():
        part.eval()
    return family, parts


def text_prompts(vocab, texts: list[str]) -> list[tuple[list[int], torch.Tensor]]:
    return [ts.encode_prompt([text], vocab, None, K, D) for text in texts]


def patches_of(kl) -> int:
    h, w = kl.grid_shape
    return (h // K) * (w // K)


def oracle(family: TransfusionFamily, target: torch.Tensor, placeholder: int, calls: list | None = None):
    """A denoise that returns the true noise of x_t around `target` (P, D) at every placeholder run (each row
    holds exactly one image), whichever branch is asked."""

    def denoise(parts, input_ids, noisy_latents, timesteps, *, document_ids=None, position_ids=None,
                unconditional=False, kv_cache=None):
        if calls is not None:
            calls.append(torch.as_tensor(unconditional).clone())
        is_patch = input_ids == placeholder
        if document_ids is not None:
            is_patch &= document_ids >= 0
        steps = torch.as_tensor(timesteps).expand(input_ids.shape) if torch.as_tensor(timesteps).dim() != 1 else \
            torch.as_tensor(timesteps)[:, None].expand(input_ids.shape)
        abar = family.schedule.alpha_bar(steps[is_patch])[:, None]
        x0 = target.double().repeat(input_ids.shape[0], 1)
        noise = (noisy_latents[is_patch].double() - abar.sqrt() * x0) / (1 - abar).sqrt()
        out = torch.zeros(*input_ids.shape, noisy_latents.shape[-1])
        out[is_patch] = noise.float()
        return out

    return denoise


# ---- the denoising loop -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cache", [True, False])
def test_an_oracle_denoiser_gives_back_the_image_through_generate(vocab, kl, monkeypatch, cache):
    family, parts = built(vocab)
    target = patchify(torch.randn(1, C, *kl.grid_shape, generator=torch.Generator().manual_seed(5)), K)[0]
    calls: list = []
    monkeypatch.setattr(family, "denoise", oracle(family, target, vocab.image_placeholder_id, calls))
    config = DiffusionSamplingConfig(mode="image", cfg_scale=3.0, seed=1, use_kv_cache=cache)  # 50 steps
    prompts = [["the cat"], ["a dog ran far away"]]
    samples, ids = family.generate(parts, vocab, kl, prompts, config)
    p = patches_of(kl)
    assert ids == [[vocab.boi_id, *[vocab.image_placeholder_id] * p, vocab.eoi_id]] * 2
    assert len(calls) == (50 if cache else 100)  # guided: both branches each step (one forward with the cache)
    expected = to_pil(kl.decode(unpatchify(target[None], K, *kl.grid_shape))[0])
    for sample in samples:
        assert len(sample) == 1 and sample[0].size == expected.size
        difference = torch.tensor(list(sample[0].getdata())) - torch.tensor(list(expected.getdata()))
        assert int(difference.abs().max()) <= 1  # a rounding step at most
    result = ts.sample(family, parts, vocab, text_prompts(vocab, ["the cat"]), config, kl.grid_shape)
    torch.testing.assert_close(patchify(result.latents[0][0][None], K)[0], target, rtol=0, atol=1e-5)


def reference_latents(family, parts, vocab, prompt_ids: list[int], x_start: torch.Tensor, steps: int,
                      scale: float) -> torch.Tensor:
    """DDIM by hand over the family's denoise: the conditional branch on the whole sequence, the unconditional one
    on `<boi>` and the image alone at the same positions."""
    p = x_start.shape[0]
    tail = [vocab.boi_id, *[vocab.image_placeholder_id] * p]
    ids = torch.tensor([prompt_ids + tail])
    alone = torch.tensor([tail])
    positions = torch.arange(len(prompt_ids), len(prompt_ids) + p + 1)[None]
    timesteps = family.schedule.ddim_timesteps(steps).tolist() + [-1]
    x = x_start.clone()
    with torch.no_grad():
        for t, t_prev in zip(timesteps[:-1], timesteps[1:]):
            noisy = torch.zeros(1, ids.shape[1], D)
            noisy[0, -p:] = x
            conditional = family.denoise(parts, ids, noisy, t)[0, -p:]
            noise = conditional
            if scale != 1.0:
                unconditional = family.denoise(parts, alone, noisy[:, -p - 1 :], t, position_ids=positions,
                                               unconditional=True)[0, 1:]
                noise = guided_noise(conditional, unconditional, scale)
            x = family.schedule.ddim_step(x, noise, torch.tensor(t), torch.tensor(t_prev), family.options.x0_clip)
    return x


@pytest.mark.parametrize("scale", [1.0, 2.5])
def test_guidance_scale_one_is_the_conditional_branch_and_s_mixes_in_the_image_alone(vocab, kl, monkeypatch, scale):
    family, parts = built(vocab)
    p, steps, seed = patches_of(kl), 6, 4
    calls: list = []
    real = family.denoise

    def spy(*args, **kwargs):
        calls.append(torch.as_tensor(kwargs.get("unconditional", False)).clone())
        return real(*args, **kwargs)

    monkeypatch.setattr(family, "denoise", spy)
    prompts = text_prompts(vocab, ["the cat sat", "one two"])
    config = DiffusionSamplingConfig(mode="image", denoising_steps=steps, cfg_scale=scale, seed=seed)
    result = ts.sample(family, parts, vocab, prompts, config, kl.grid_shape)
    assert len(calls) == steps
    if scale == 1.0:  # the unconditional branch is never run
        assert all(not bool(c.any()) and c.numel() in (1, 2) for c in calls)
    else:  # one forward over both: conditional rows, then unconditional ones
        assert all(c.tolist() == [False, False, True, True] for c in calls)
    monkeypatch.setattr(family, "denoise", real)
    x_start = torch.randn(2, p, D, generator=torch.Generator().manual_seed(seed))
    for row, (ids, _) in enumerate(prompts):
        expected = reference_latents(family, parts, vocab, ids, x_start[row], steps, scale)
        got = patchify(result.latents[row][0][None], K)[0]
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    other = ts.sample(family, parts, vocab, prompts, DiffusionSamplingConfig(
        mode="image", denoising_steps=steps, cfg_scale=1.0 if scale != 1.0 else 2.5, seed=seed), kl.grid_shape)
    assert not torch.allclose(other.latents[0][0], result.latents[0][0], rtol=1e-3)  # the scale matters


def forcing_boi(schedule: dict[int, list[int]]):
    """choose_next_tokens, except that prompt b takes `<boi>` at its calls schedule[b] (where the rules allow it):
    so a random model opens images at chosen steps."""
    real = step_module.choose_next_tokens
    count = [0]

    def choose(logits, n_prompts, rules, seen_text, config, noise, pad_id):
        token = real(logits, n_prompts, rules, seen_text, config, noise, pad_id)
        allowed = rules.allowed()
        for b, calls in schedule.items():
            if count[0] in calls and bool(allowed[b, rules.boi_id]) and not bool(rules.done[b]):
                token[b] = rules.boi_id
        count[0] += 1
        return token

    return choose


def test_the_cached_path_gives_the_full_recomputes_ids_and_latents(vocab, kl, files, monkeypatch):
    family, parts = built(vocab, seed=1)
    p = patches_of(kl)
    prompts = [ts.encode_prompt(["the cat"], vocab, kl, K, D),
               ts.encode_prompt([files / "photo.png", "a dog ran far"], vocab, kl, K, D),
               ts.encode_prompt(["one"], vocab, kl, K, D)]
    results, grown = [], []
    real_make_room = ts.CachedRows._make_room

    def make_room(rows, tokens):
        before = rows.cache.max_len
        real_make_room(rows, tokens)
        grown.append(rows.cache.max_len > before)

    monkeypatch.setattr(ts.CachedRows, "_make_room", make_room)
    for cache in (True, False):
        # prompt 0 opens an image at once and another after its first one and three tokens (which reads the first
        # one's keys and values), prompt 2 at its second token, prompt 1 (after its prompt image) at its fourth
        monkeypatch.setattr(step_module, "choose_next_tokens", forcing_boi({0: [0, 4], 1: [3], 2: [1]}))
        config = DiffusionSamplingConfig(mode="interleaved", denoising_steps=4, cfg_scale=2.0, seed=7,
                                         max_new_tokens=2 * (p + 2) + 6, text_temperature=0.8, text_top_k=40,
                                         repetition_penalty=1.3, use_kv_cache=cache)
        results.append(ts.sample(family, parts, vocab, prompts, config, kl.grid_shape))
    cached, full = results
    assert cached.ids == full.ids
    assert any(grown)  # the padding slots of rows waiting for others' images outgrew the first cache
    for row in cached.ids:  # each prompt made an image and went on with text after it
        assert row.count(vocab.boi_id) >= 1 and row.count(vocab.eoi_id) == row.count(vocab.boi_id)
        assert row.index(vocab.eoi_id) < len(row) - 1
    assert cached.ids[0][0] == cached.ids[0][p + 5] == cached.ids[1][3] == cached.ids[2][1] == vocab.boi_id
    for got_row, expected_row in zip(cached.latents, full.latents):
        assert len(got_row) == len(expected_row) >= 1
        for got, expected in zip(got_row, expected_row):
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert cached.stats["denoising_steps"] == full.stats["denoising_steps"] == 4 * 4  # four image phases
    assert cached.stats["forwards"] < full.stats["forwards"]  # a guided step is one forward with the cache


def test_the_prefix_is_computed_once_and_the_clean_image_written_once(vocab, kl, monkeypatch):
    family, parts = built(vocab)
    p, steps = patches_of(kl), 5
    model = parts["model"]
    forwards: list[tuple[int, int | None]] = []  # (tokens fed, cached tokens before them)
    real_forward = model.forward_hidden

    def counting(input_ids, *args, **kwargs):
        cache = args[2] if len(args) > 2 else kwargs.get("kv_cache")
        forwards.append((input_ids.shape[1], None if cache is None else cache.length))
        return real_forward(input_ids, *args, **kwargs)

    monkeypatch.setattr(model, "forward_hidden", counting)
    clean_writes: list[torch.Tensor] = []  # the patches fed at t = 0
    real_embed = parts["patches"].embed

    def embedding(noisy, t):
        if t.numel() and not bool(t.any()):
            clean_writes.append(noisy.clone())
        return real_embed(noisy, t)

    monkeypatch.setattr(parts["patches"], "embed", embedding)
    monkeypatch.setattr(step_module, "choose_next_tokens", forcing_boi({0: [0]}))
    prompt = text_prompts(vocab, ["the cat sat on"])
    length = len(prompt[0][0])
    text_after = 3
    config = DiffusionSamplingConfig(mode="interleaved", denoising_steps=steps, cfg_scale=3.0, seed=0,
                                     max_new_tokens=p + 2 + text_after, text_temperature=0)
    result = ts.sample(family, parts, vocab, prompt, config, kl.grid_shape)
    assert result.ids[0][: p + 2] == [vocab.boi_id, *[vocab.image_placeholder_id] * p, vocab.eoi_id]
    assert len(result.ids[0]) == p + 2 + text_after
    # the prompt once; each DDIM step feeds <boi> and the patches after the cached prompt; one write of <boi>,
    # the clean patches and <eoi>; then one token per forward
    assert forwards[0] == (length, 0)
    assert forwards[1 : 1 + steps] == [(p + 1, length)] * steps
    assert forwards[1 + steps] == (p + 2, length)
    assert forwards[2 + steps :] == [(1, length + p + 2 + i) for i in range(text_after - 1)]
    # at t = 0: the last DDIM step (both branches), then the clean image through the patch projection once
    assert [len(patches) for patches in clean_writes] == [2 * p, p]
    torch.testing.assert_close(clean_writes[1], patchify(result.latents[0][0][None], K)[0], rtol=0, atol=0)
    assert result.stats == {"forwards": len(forwards), "denoising_steps": steps, "image_writes": 1}

    forwards.clear()
    clean_writes.clear()
    image_mode = ts.sample(family, parts, vocab, prompt, replace_config(config, mode="image", max_new_tokens=None),
                           kl.grid_shape)
    assert image_mode.stats["image_writes"] == 0  # nothing follows: nothing to write
    assert [len(patches) for patches in clean_writes] == [2 * p]
    assert forwards == [(length, 0)] + [(p + 1, length)] * steps


def replace_config(config: DiffusionSamplingConfig, **changes) -> DiffusionSamplingConfig:
    from dataclasses import replace

    return replace(config, **changes)


@pytest.mark.parametrize("cache", [True, False])
def test_text_follows_the_samplers_rules_token_for_token(vocab, kl, cache):
    from fusion_model.sampling import generate_ids

    family, parts = built(vocab, seed=2)
    with torch.no_grad():  # logits of a few units, as a trained model's, so penalty, top-k and top-p all matter
        parts["model"].head.weight.mul_(100)
    prompts = text_prompts(vocab, ["the cat sat on the mat", "a dog"])
    config = DiffusionSamplingConfig(mode="text", max_new_tokens=12, text_temperature=1.5, text_top_k=3,
                                     text_top_p=0.9, repetition_penalty=1.3, seed=3, use_kv_cache=cache)
    got = ts.sample(family, parts, vocab, prompts, config, kl.grid_shape).ids
    # a text-only prompt never reaches the patch projections: the decoder alone through the chameleon sampler
    expected = generate_ids(parts["model"], vocab, [ids for ids, _ in prompts], config)
    assert got == expected and all(len(ids) == 12 for ids in got)


def test_settings_it_cannot_honour_are_refused_in_a_sentence(vocab, kl, files):
    family, parts = built(vocab)
    prompts = [["the cat"]]
    refusals = [
        (DiffusionSamplingConfig(compile=True), "--compile is not available"),
        (DiffusionSamplingConfig(speculative_window=4), "--speculative-window"),
        (SamplingConfig.chameleon(), "use --cfg-scale"),
        (DiffusionSamplingConfig(denoising_steps=1001), "between 1 and the checkpoint's diffusion_steps 1000"),
    ]
    for config, message in refusals:
        with pytest.raises(ValueError, match=message):
            family.generate(parts, vocab, kl, prompts, config)
    with pytest.raises(ValueError, match="continuous latents, but --image-tokenizer is a vq"):
        family.generate(parts, vocab, ImageTokenizer.from_pretrained(files / "vq"), prompts, SamplingConfig())
    with pytest.raises(ValueError, match="give the continuous image tokenizer"):
        family.generate(parts, vocab, None, prompts, SamplingConfig(mode="image"))
    samples, ids = family.generate(parts, vocab, None, prompts, SamplingConfig(mode="text", max_new_tokens=3))
    assert len(ids[0]) == 3 and vocab.boi_id not in ids[0]
    with pytest.raises(ValueError, match="denoising_steps=0 must be >= 1"):
        DiffusionSamplingConfig(denoising_steps=0)


# ---- train.py generate --------------------------------------------------------------------------------------------


def transfusion_checkpoint(files, vocab, kl) -> str:
    from fusion_model.training.lightning_module import FusionLightningModule

    torch.manual_seed(0)
    module = FusionLightningModule(family_config(vocab), family="transfusion", family_options=family_options(vocab),
                                   tokenizers={"vocab": vocab.fingerprint(), "image_tokenizer": kl.fingerprint()})
    path = files / "transfusion.ckpt"
    torch.save({"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams)}, path)
    return str(path)


def test_train_py_generate_writes_png_json_and_html_from_a_transfusion_checkpoint(files, vocab, kl, tmp_path,
                                                                                  capsys):
    checkpoint = transfusion_checkpoint(files, vocab, kl)
    base = ["generate", "--checkpoint", checkpoint, "--vocab", str(files / "tokenizer.json"), "--image-tokenizer",
            str(files / "kl")]
    out = tmp_path / "image"
    argv = [*base, "--prompt", "the cat", "--mode", "image", "--denoising-steps", "3", "--cfg-scale", "2",
            "--num-samples", "2", "--out", str(out)]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "prompt: the cat" in printed and "2 samples, 2 generated image files" in printed
    assert len(list(out.glob("*.png"))) == 2 and (out / "index.html").is_file()
    written = json.loads((out / "samples.json").read_text())
    assert written["settings"]["denoising_steps"] == 3 and written["settings"]["cfg_scale"] == 2.0
    assert all(len(ids) == patches_of(kl) + 2 for ids in [s["ids"] for s in written["samples"]])

    out = tmp_path / "interleaved"
    argv = [*base, "--image", str(files / "photo.png"), "--prompt", "the cat", "--max-new-tokens", "6",
            "--text-temperature", "0", "--out", str(out)]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "prompt: <image:" in printed and "the cat" in printed and "output: " in printed
    assert (out / "samples.json").is_file() and (out / "index.html").is_file()

    assert cli.main([*base, "--prompt", "x", "--compile", "--out", str(tmp_path / "no")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--compile is not available" in err
    assert not (tmp_path / "no").exists()
