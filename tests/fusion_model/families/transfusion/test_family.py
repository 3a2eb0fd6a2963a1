"""The Transfusion family: its loss against a hand computation (CE + lambda MSE at the same keyed steps and noise),
attention (bidirectional only inside an image, never across documents; causal with the ablation switch; a
caption-dropped image sees only itself), the sampler's `denoise` against the training forward, keyed draws that
follow the token keys, accumulation 2 x 1 = 1 x 2, gradient reach, the latent patch layout, and a short fit
through the Lightning module."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import lightning as L
import numpy as np
import pytest
import torch

from data_shards.stream import with_window_denominators
from fusion_model.config import FusionConfig
from fusion_model.families import family_class
from fusion_model.families.base import OPTIONAL_BATCH_KEYS, ObjectiveContext
from fusion_model.families.transfusion.family import TransfusionFamily
from fusion_model.families.transfusion.layout import image_layout, visible_from
from fusion_model.layers import attention_backends as attn_lib
from fusion_model.layers.keyed_random import keyed_normal, keyed_uniform
from fusion_model.model import FusionModel
from tokenizer.layout import patchify, unpatchify

PAD, BOS, EOS, BOI, EOI, PH = 0, 1, 2, 3, 4, 6  # the unified vocabulary's specials (<image> = 6)
C, K = 4, 2
D = C * K * K
IMAGE = dict(image_offset=128, image_codes=64)
OPTIONS = dict(latent_channels=C, patch_size=K, image_placeholder_id=PH)

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: one torch thread, restored after


def config(**overrides) -> FusionConfig:
    return FusionConfig.from_preset("tiny", **{**IMAGE, **overrides})


def family(options: dict | None = None, **config_overrides) -> TransfusionFamily:
    return TransfusionFamily(config(**config_overrides), {**OPTIONS, **(options or {})})


@dataclass
class Doc:
    """One document: its ids, its token keys (its identity in the dataset) and its clean latents per position."""

    ids: torch.Tensor
    keys: torch.Tensor
    latents: torch.Tensor


def doc(key: int, *segments: list[int] | int) -> Doc:
    """<s> segments </s>: a list is text ids, an int P an image of P patches (<boi> P placeholders <eoi>), whose
    latents are random but fixed by the document's key."""
    ids = [BOS]
    for segment in segments:
        ids += [BOI, *[PH] * segment, EOI] if isinstance(segment, int) else list(segment)
    ids.append(EOS)
    ids = torch.tensor(ids)
    latents = torch.zeros(len(ids), D)
    generator = torch.Generator().manual_seed(key)
    latents[ids == PH] = torch.randn(int((ids == PH).sum()), D, generator=generator)
    return Doc(ids, key * 1000 + torch.arange(len(ids)), latents)


def pack(rows: list[list[Doc]], length: int) -> dict[str, torch.Tensor]:
    """Rows of documents, padded to `length` (id 0, document -1, key -1)."""
    batch = {"input_ids": torch.full((len(rows), length), PAD), "document_ids": torch.full((len(rows), length), -1),
             "position_ids": torch.zeros(len(rows), length, dtype=torch.long),
             "token_keys": torch.full((len(rows), length), -1), "image_latents": torch.zeros(len(rows), length, D)}
    for r, docs in enumerate(rows):
        at = 0
        for number, d in enumerate(docs):
            span = slice(at, at + len(d.ids))
            batch["input_ids"][r, span], batch["token_keys"][r, span] = d.ids, d.keys
            batch["document_ids"][r, span], batch["position_ids"][r, span] = number, torch.arange(len(d.ids))
            batch["image_latents"][r, span] = d.latents
            at += len(d.ids)
        assert at <= length
    return batch


def documents() -> list[Doc]:
    """Caption then image, image then caption, two images, text only."""
    return [doc(1, [20, 21, 22], 4), doc(2, 4, [30, 31]), doc(3, [40], 4, [41], 4, [42]), doc(4, [50, 51, 52, 53])]


def batch_of_four() -> dict[str, torch.Tensor]:
    one, two, three, four = documents()
    return pack([[one, four], [two], [three], [four, two]], 28)


def built(fam: TransfusionFamily, seed: int = 0) -> dict[str, torch.nn.Module]:
    torch.manual_seed(seed)
    return fam.build()


# ---- options and registry ---------------------------------------------------------------------------------------


def test_the_family_is_registered_and_its_options_are_checked_with_sentences():
    assert family_class("transfusion") is TransfusionFamily
    assert "image_latents" in OPTIONAL_BATCH_KEYS and set(TransfusionFamily.batch_keys) <= set(OPTIONAL_BATCH_KEYS)
    options = family().options
    assert (options.diffusion_weight, options.diffusion_steps, options.caption_dropout, options.image_bidirectional,
            options.max_t_image_first, options.latent_dim) == (5.0, 1000, 0.1, True, 500, D)
    with pytest.raises(ValueError, match=r"no model.family_options \['depth'\].*latent_channels"):
        family({"depth": 2})
    for name, value in [("latent_channels", 0), ("patch_size", 1.5), ("diffusion_weight", float("nan")),
                        ("caption_dropout", 1.0), ("image_bidirectional", "yes"), ("diffusion_steps", True),
                        ("max_t_image_first", -1), ("image_placeholder_id", -6)]:
        with pytest.raises(ValueError, match=rf"family_options\.{name}="):
            family({name: value})
    with pytest.raises(ValueError, match=r"needs model.family_options \['latent_channels'\]"):
        TransfusionFamily(config(), {"image_placeholder_id": PH})
    with pytest.raises(ValueError, match="disagree"):
        TransfusionFamily(config(image_placeholder_id=7), OPTIONS)
    with pytest.raises(ValueError, match="image_bidirectional"):
        TransfusionFamily(config(image_bidirectional=True), {**OPTIONS, "image_bidirectional": False})
    with pytest.raises(ValueError, match="is an image code"):
        TransfusionFamily(config(), {**OPTIONS, "image_placeholder_id": 130})


def test_derive_options_reads_the_manifest_and_the_vocabulary():
    class Vocab:
        image_placeholder_id = 6

    manifest = {"latent": {"channels": 8, "grid": [32, 32], "patch_size": 2}, "feature_kind": "latent"}
    options = {"patch_size": 2, "image_placeholder_id": 7}
    TransfusionFamily.derive_options(options, manifest, Vocab())
    assert options == {"latent_channels": 8, "patch_size": 2, "image_placeholder_id": 7}  # given ones win
    # but the patches' layout is the shards': another patch size or channel count is refused in one sentence
    for name, value in (("patch_size", 1), ("latent_channels", 4)):
        with pytest.raises(ValueError, match=f"{name}={value} but the token shards hold .*--patch-size"):
            TransfusionFamily.derive_options({name: value}, manifest, Vocab())
    options = {}
    TransfusionFamily.derive_options(options, {**manifest, "image_placeholder_id": 9}, None)
    assert options == {"latent_channels": 8, "patch_size": 2, "image_placeholder_id": 9}


def test_the_decoder_reads_the_placeholder_as_an_image_position():
    fam = family()
    model = built(fam)["model"]
    assert model.config.image_placeholder_id == PH and model.config.image_bidirectional
    assert not family({"image_bidirectional": False}).config.image_bidirectional
    assert fam.exportable is False and fam.scores_image_positions is False


# ---- the latent patch layout ------------------------------------------------------------------------------------


def test_patchify_is_row_major_patches_channel_major_inside_and_unpatchify_inverts_it():
    latents = torch.randn(2, 3, 4, 6)
    patches = patchify(latents, 2)
    assert patches.shape == (2, 6, 12)
    for n in range(2):
        for row in range(2):
            for col in range(3):
                for c in range(3):
                    for i in range(2):
                        for j in range(2):
                            got = patches[n, row * 3 + col, c * 4 + i * 2 + j]
                            assert got == latents[n, c, row * 2 + i, col * 2 + j]
    assert torch.equal(unpatchify(patches, 2, 4, 6), latents)
    as_array = patchify(latents.numpy(), 2)
    assert isinstance(as_array, np.ndarray) and np.array_equal(as_array, patches.numpy())
    assert np.array_equal(unpatchify(as_array, 2, 4, 6), latents.numpy())
    with pytest.raises(ValueError, match="multiple of patch_size"):
        patchify(latents, 4)
    with pytest.raises(ValueError, match="do not tile"):
        unpatchify(patches, 2, 4, 4)


def test_image_layout_finds_each_run_its_boi_and_whether_it_opens_a_captioned_document():
    batch = batch_of_four()
    layout = image_layout(batch["input_ids"], batch["document_ids"], PH)
    flat = batch["input_ids"].reshape(-1)
    assert layout.count == 5 and layout.patches.tolist() == [4] * 5
    assert bool((flat[layout.start] == PH).all()) and bool((flat[layout.opener] == BOI).all())
    assert bool((flat[layout.start - 1] == BOI).all())
    # doc 1 (caption first): no; doc 2 (image, then a caption): yes (twice); doc 3's images: no
    assert layout.image_first.tolist() == [False, True, False, False, True]
    alone = pack([[doc(5, 4), doc(6, 4, [60])]], 20)  # an image with nothing after it but </s>; one with a word
    assert image_layout(alone["input_ids"], alone["document_ids"], PH).image_first.tolist() == [False, True]
    # a document cut inside an image: the rest of the run in the next piece is an image of its own, with no <boi>
    ids = torch.tensor([[BOS, BOI, PH, PH, PH, PH, EOI, EOS]])
    cut = image_layout(ids, torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1]]), PH)
    assert cut.start.tolist() == [2, 4] and cut.opener.tolist() == [1, 4] and cut.patches.tolist() == [2, 2]


# ---- the loss against a hand computation ------------------------------------------------------------------------


def hand_loss(fam: TransfusionFamily, parts, batch, step: int, seed: int = 0):
    """(text total, text count, diffusion total, image count), computed here from the keyed draws."""
    model, patches = parts["model"], parts["patches"]
    ids, docs, keys = batch["input_ids"], batch["document_ids"], batch["token_keys"]
    steps = fam.options.diffusion_steps
    bars = []

    def f(u: float) -> float:
        return math.cos((u + 0.008) / 1.008 * math.pi / 2) ** 2

    embeds = model.embed(ids).clone()
    noise_of, images = {}, []
    for b in range(ids.shape[0]):
        t_index = 0
        while t_index < ids.shape[1]:
            if ids[b, t_index] != PH or docs[b, t_index] < 0:
                t_index += 1
                continue
            end = t_index
            while end + 1 < ids.shape[1] and ids[b, end + 1] == PH and docs[b, end + 1] == docs[b, t_index]:
                end += 1
            u = keyed_uniform(keys[b, t_index : t_index + 1], seed=seed, step=step, stream="transfusion_timestep")
            t = int(u.item() * steps)
            bar = f((t + 1) / steps) / f(0)
            bars.append(bar)
            eps = keyed_normal(keys[b, t_index : end + 1], seed=seed, step=step, stream="transfusion_noise", draws=D)
            x_t = math.sqrt(bar) * batch["image_latents"][b, t_index : end + 1] + math.sqrt(1 - bar) * eps
            half = 128
            angles = t * torch.exp(-math.log(10_000.0) * torch.arange(half) / half)
            time = patches.time.mlp(torch.cat([torch.cos(angles), torch.sin(angles)]))
            embeds[b, t_index : end + 1] = patches.patch_in(x_t) + time
            noise_of[(b, t_index, end)] = eps
            images.append((b, t_index, end))
            t_index = end + 1
    hidden = model.forward_hidden(ids, batch["position_ids"], docs, inputs_embeds=embeds)
    logits = model.head(hidden).float()
    ce_total, count = 0.0, 0
    for b in range(ids.shape[0]):
        for t_index in range(ids.shape[1] - 1):
            target = ids[b, t_index + 1]
            if docs[b, t_index] < 0 or docs[b, t_index] != docs[b, t_index + 1] or target == PH:
                continue
            lse = torch.logsumexp(logits[b, t_index], -1)
            ce_total = ce_total + lse - logits[b, t_index, target] + fam.config.z_loss_coef * lse ** 2
            count += 1
    mse_total = 0.0
    for (b, start, end), eps in noise_of.items():
        predicted = patches.patch_out(hidden[b, start : end + 1])
        mse_total = mse_total + ((predicted - eps) ** 2).mean()
    return ce_total, count, mse_total, len(images)


@pytest.mark.parametrize("norm_placement", ["pre", "swin"])
def test_the_loss_is_text_ce_plus_z_loss_and_lambda_times_the_per_image_noise_mse(norm_placement):
    fam = family({"caption_dropout": 0.0, "max_t_image_first": None, "diffusion_weight": 2.5},
                 norm_placement=norm_placement, z_loss_coef=1e-2)
    parts = built(fam)
    batch = batch_of_four()
    objective = fam.objective(parts, batch, ObjectiveContext(step=7))
    ce_total, count, mse_total, images = hand_loss(fam, parts, batch, step=7)
    text, diffusion = objective.terms["text"], objective.terms["diffusion"]
    # every document's text targets, none whose target is a placeholder (each <boi> position's included)
    assert int(text.count) == count == 6 + 5 + 9 + 5 + 5 + 4
    assert float(diffusion.count) == images == 5 and diffusion.weight == 2.5
    torch.testing.assert_close(text.total, ce_total, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(diffusion.total, mse_total, rtol=1e-5, atol=1e-6)
    expected = ce_total / count + 2.5 * mse_total / images
    torch.testing.assert_close(objective.loss(objective.counts()), expected, rtol=1e-5, atol=1e-6)
    assert {"ce", "z_loss", "text_loss", "diffusion_mse"} == set(objective.metrics)
    counted = fam.denominators(batch)
    assert float(counted["text"]) == count and float(counted["diffusion"]) == images


def test_steps_of_an_image_that_opens_a_captioned_document_stay_below_max_t_image_first():
    fam = family({"max_t_image_first": 100})
    batch = batch_of_four()
    layout = fam.layout(batch)
    first, other = [], []
    for step in range(40):
        draws = fam.draws(batch, ObjectiveContext(step=step))
        first += draws.timesteps[layout.image_first].tolist()
        other += draws.timesteps[~layout.image_first].tolist()
    assert max(first) <= 100 and max(other) > 100 and min(other) >= 0
    assert max(other) <= 999 and len(set(first)) > 10


# ---- attention ----------------------------------------------------------------------------------------------------


def rule_mask(batch, bidirectional: bool, unconditional_from: dict[int, int] | None = None) -> torch.Tensor:
    """The attention rule written pair by pair: same document, causal, and (bidirectional) both in the same
    placeholder run; a query listed in unconditional_from (flat index -> key column) sees nothing before it."""
    ids, docs = batch["input_ids"], batch["document_ids"]
    rows, length = ids.shape
    mask = torch.zeros(rows, 1, length, length, dtype=torch.bool)
    for b in range(rows):
        for q in range(length):
            for k in range(length):
                if docs[b, q] < 0:
                    mask[b, 0, q, k] = q == k
                    continue
                same = bool(docs[b, q] == docs[b, k])
                run = bidirectional and bool(ids[b, q] == PH) and bool(ids[b, k] == PH) and all(
                    bool(ids[b, i] == PH) for i in range(min(q, k), max(q, k) + 1))
                allowed = same and (k <= q or run)
                if unconditional_from and b * length + q in unconditional_from:
                    allowed = allowed and k >= unconditional_from[b * length + q]
                mask[b, 0, q, k] = allowed
    return mask


@pytest.mark.parametrize("bidirectional", [True, False])
def test_attention_is_bidirectional_only_inside_an_image_and_never_crosses_documents(bidirectional):
    fam = family({"image_bidirectional": bidirectional})
    model = built(fam)["model"]
    batch = batch_of_four()
    ctx, _ = model.attention_context(batch["input_ids"], batch["document_ids"], batch["position_ids"], None)
    assert torch.equal(ctx.mask, rule_mask(batch, bidirectional))
    if bidirectional:  # the rule is not vacuous: some key after its query is visible
        assert bool((ctx.mask & ~rule_mask(batch, False)).any())


def step_where(fam: TransfusionFamily, batch, wanted: dict[int, bool]) -> int:
    """The first step at which each listed image (by number) is dropped or kept as wanted."""
    return next(s for s in range(200) if all(
        bool(fam.draws(batch, ObjectiveContext(step=s)).dropped[i]) == drop for i, drop in wanted.items()))


def positions(batch, draws) -> tuple[torch.Tensor, torch.Tensor]:
    """The draws laid out per position: noisy latents (B, T, D) and steps (B, T)."""
    layout = draws.layout
    noisy = torch.zeros_like(batch["image_latents"])
    noisy[layout.is_patch] = draws.noisy
    steps = torch.zeros_like(batch["input_ids"])
    steps[layout.is_patch] = draws.timesteps[layout.patch_image()]
    return noisy, steps


def test_a_caption_dropped_image_sees_only_its_boi_and_itself_and_the_text_after_still_sees_it():
    fam = family({"caption_dropout": 0.5})
    batch = batch_of_four()
    # image 0 (row 0: <s> 20 21 22 <boi> 4 patches <eoi> </s>) dropped; image 2 (row 2, after the word 40) kept
    context = ObjectiveContext(step=step_where(fam, batch, {0: True, 2: False}))
    draws = fam.draws(batch, context)
    layout, length = draws.layout, batch["input_ids"].shape[1]
    visible = visible_from(layout, draws.dropped, batch["input_ids"].shape)
    parts = built(fam)
    ctx, _ = parts["model"].attention_context(batch["input_ids"], batch["document_ids"], batch["position_ids"],
                                              None, visible)
    limits = {}
    for image in draws.dropped.nonzero().flatten().tolist():
        opener, start = int(layout.opener[image]), int(layout.start[image])
        for flat in range(opener, start + int(layout.patches[image])):
            limits[flat] = opener % length
    assert torch.equal(ctx.mask, rule_mask(batch, True, limits))
    # in the forward: the dropped image's prediction ignores its caption, the kept one's does not, and the text
    # after the dropped image still sees both its caption and the image
    _, hidden, predicted = fam.training_forward(parts, batch, context)
    changed = {**batch, "input_ids": batch["input_ids"].clone()}
    changed["input_ids"][0, 1] = 99
    changed["input_ids"][2, 1] = 99
    _, hidden_changed, predicted_changed = fam.training_forward(parts, changed, context)
    image = layout.patch_image()
    torch.testing.assert_close(predicted_changed[image == 0], predicted[image == 0], rtol=0, atol=1e-6)
    assert not torch.allclose(predicted_changed[image == 2], predicted[image == 2], atol=1e-4)
    assert not torch.allclose(hidden_changed[0, 9], hidden[0, 9], atol=1e-4)  # <eoi> reads the caption
    changed = {**batch, "image_latents": batch["image_latents"].clone()}
    changed["image_latents"][0, 5] += 1.0  # a patch of the dropped image
    _, hidden_changed, _ = fam.training_forward(parts, changed, context)
    assert not torch.allclose(hidden_changed[0, 9], hidden[0, 9], atol=1e-4)  # and the image


def test_the_flex_backend_gives_the_sdpa_objective_with_dropped_captions_and_image_runs():
    pytest.importorskip("torch.nn.attention.flex_attention")
    batch = batch_of_four()
    sdpa = family({"caption_dropout": 0.5})
    flex = family({"caption_dropout": 0.5}, attention_backend="flex")
    context = ObjectiveContext(step=step_where(sdpa, batch, {0: True, 2: False}))
    parts_sdpa, parts_flex = built(sdpa), built(flex)
    with warnings.catch_warnings(), torch.no_grad():  # flex has no backward on CPU
        warnings.simplefilter("ignore")  # eager flex on CPU warns that it is for debugging only
        expected, got = sdpa.objective(parts_sdpa, batch, context), flex.objective(parts_flex, batch, context)
    for name in ("text", "diffusion"):
        torch.testing.assert_close(got.terms[name].total, expected.terms[name].total, rtol=1e-4, atol=1e-5)


# ---- the sampler's denoiser -------------------------------------------------------------------------------------


def test_denoise_at_step_t_is_the_training_forward_at_that_step_for_a_prefix_alone():
    fam = family({"caption_dropout": 0.5})
    parts = built(fam)
    for module in parts.values():
        module.eval()
    batch = batch_of_four()
    # image 3 (row 2's second image, after an earlier image) dropped; image 0 kept
    context = ObjectiveContext(step=step_where(fam, batch, {0: False, 3: True}))
    with torch.no_grad():
        draws, _, predicted = fam.training_forward(parts, batch, context)
    layout, length = draws.layout, batch["input_ids"].shape[1]
    image = layout.patch_image()
    noisy, steps = positions(batch, draws)
    for index, unconditional in [(0, False), (3, True)]:
        # the sampler's view: the document up to the image's last patch, alone in a row of its own
        row, start = divmod(int(layout.start[index]), length)
        first, end = start - int(batch["position_ids"][row, start]), start + int(layout.patches[index])
        ids = batch["input_ids"][row : row + 1, first:end]
        with torch.no_grad():
            got = fam.denoise(parts, ids, noisy[row : row + 1, first:end], steps[row : row + 1, first:end],
                              unconditional=unconditional)
        torch.testing.assert_close(got[0, start - first :], predicted[image == index], rtol=1e-4, atol=1e-5)
        assert bool((got[0, ids[0] != PH] == 0).all())
    with torch.no_grad():  # the two branches differ: guidance has two predictions to mix
        start = int(layout.start[0])
        ids, x_t, t = batch["input_ids"][:1, : start + 4], noisy[:1, : start + 4], int(draws.timesteps[0])
        conditional = fam.denoise(parts, ids, x_t, t)
        unconditional = fam.denoise(parts, ids, x_t, torch.tensor([t]), unconditional=True)
        alone = fam.denoise(parts, ids[:, start - 1 :], x_t[:, start - 1 :], t)
    assert not torch.allclose(conditional, unconditional, atol=1e-4)
    # the unconditional branch is the image with its <boi> alone (RoPE sees relative positions only)
    torch.testing.assert_close(unconditional[:, start - 1 :], alone, rtol=1e-4, atol=1e-5)


def test_denoise_after_a_prefilled_text_prefix_equals_the_whole_row():
    fam = family()
    parts = built(fam)
    model = parts["model"].eval()
    ids = torch.tensor([[BOS, 20, 21, 22, BOI, PH, PH, PH, PH]])
    noisy = torch.zeros(1, 9, D)
    noisy[0, 5:] = torch.randn(4, D)
    with torch.no_grad():
        cache = model.new_kv_cache(1, 16)
        model.forward_hidden(ids[:, :4], kv_cache=cache)  # the text prefix, once
        for unconditional in (False, True):
            expected = fam.denoise(parts, ids, noisy, 321, unconditional=unconditional)
            got = fam.denoise(parts, ids[:, 4:], noisy[:, 4:], torch.tensor([321]), kv_cache=cache,
                              unconditional=unconditional)
            torch.testing.assert_close(got, expected[:, 4:], rtol=1e-4, atol=1e-5)
            cache.truncate(4)  # the prefix stays for the next step
        assert not torch.allclose(fam.denoise(parts, ids, noisy, 321), expected, atol=1e-4)


# ---- keyed draws, accumulation, gradients -------------------------------------------------------------------------


def draws_by_key(fam, batch, step):
    """{first patch key: (step t, dropped, noise of its patches)}."""
    draws = fam.draws(batch, ObjectiveContext(step=step))
    layout, keys = draws.layout, batch["token_keys"].reshape(-1)
    image = layout.patch_image()
    return {int(keys[s]): (int(draws.timesteps[i]), bool(draws.dropped[i]), draws.noise[image == i])
            for i, s in enumerate(layout.start.tolist())}


def test_keyed_steps_and_noise_follow_the_token_keys_not_the_row_nor_the_batch_split():
    fam = family({"caption_dropout": 0.5})
    one, two, three, four = documents()
    whole = draws_by_key(fam, pack([[one, four], [two], [three], [four, two]], 28), step=3)
    moved = {**draws_by_key(fam, pack([[two], [four, four, one]], 40), step=3),
             **draws_by_key(fam, pack([[three, two]], 30), step=3)}
    assert whole.keys() == moved.keys() and len(whole) == 4  # doc 2's image appears twice: one key
    for key, (t, dropped, noise) in whole.items():
        assert moved[key][:2] == (t, dropped)
        assert torch.equal(moved[key][2], noise)
    later = draws_by_key(fam, pack([[one, four], [two], [three], [four, two]], 28), step=4)
    assert any(later[key][0] != whole[key][0] for key in whole)
    assert len({t for t, _, _ in whole.values()}) > 1


def test_gradients_of_one_batch_equal_the_sum_over_its_split_each_term_over_its_global_count():
    fam = family({"caption_dropout": 0.5})
    parts = built(fam)
    one, two, three, four = documents()
    big = pack([[one, four], [two], [three], [four, two]], 28)
    halves = [pack([[one, four], [two]], 28), pack([[three], [four, two]], 28)]
    context = ObjectiveContext(step=2)
    params = [p for part in parts.values() for p in part.parameters()]

    def grads(batches):
        counted = [fam.denominators(b) for b in batches]
        total = {name: sum(c[name] for c in counted) for name in counted[0]}
        for p in params:
            p.grad = None
        for b in batches:
            objective = fam.objective(parts, b, context)
            objective.loss(torch.stack([total[name] for name in objective.terms])).backward()
        return [p.grad.clone() for p in params]

    for expected, got in zip(grads([big]), grads(halves)):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-7)
    # the split differs in counts: a mean per micro-batch would not be the same gradient
    assert [float(fam.denominators(h)["diffusion"]) for h in halves] == [2.0, 3.0]


def test_gradients_reach_the_patch_projections_the_timestep_mlp_and_the_decoder():
    fam = family()
    parts = built(fam)
    objective = fam.objective(parts, batch_of_four(), ObjectiveContext(step=1))
    objective.loss(objective.counts()).backward()
    for name, part in parts.items():
        for parameter_name, p in part.named_parameters():
            assert p.grad is not None and bool(p.grad.abs().sum() > 0), f"{name}.{parameter_name}"
    # a text-only batch still reaches every weight (zeros), so data-parallel ranks stay in step
    for part in parts.values():
        part.zero_grad(set_to_none=True)
    text_only = pack([[documents()[3]]], 12)
    objective = fam.objective(parts, text_only, ObjectiveContext(step=1))
    assert float(objective.terms["diffusion"].count) == 0
    objective.loss(objective.counts()).backward()
    assert all(p.grad is not None for part in parts.values() for p in part.parameters())


def test_flops_per_token_add_the_patch_projections_and_the_timestep_mlp():
    fam = family()
    patches = built(fam)["patches"]
    assert patches.matmul_parameters() == 2 * D * 64 + 256 * 64 + 64 * 64
    assert fam.flops_per_token(128) == fam.config.flops_per_token(128) + 6.0 * patches.matmul_parameters()


def test_missing_batch_entries_are_a_sentence():
    fam = family()
    batch = batch_of_four()
    with pytest.raises(ValueError, match="needs batches with image_latents"):
        fam.objective(built(fam), {k: v for k, v in batch.items() if k != "image_latents"}, ObjectiveContext(step=0))
    with pytest.raises(ValueError, match="image_latents has shape"):
        fam.objective(built(fam), {**batch, "image_latents": batch["image_latents"][..., :3]}, ObjectiveContext(0))


# ---- the chameleon path is unchanged ----------------------------------------------------------------------------


def test_without_a_placeholder_id_image_runs_and_the_decoder_are_bit_identical():
    ids = torch.tensor([[BOS, 130, 131, PH, PH, 132, EOS, 20]])
    assert attn_lib.image_runs(ids, 128, 64).tolist() == [[-1, 1, 1, -1, -1, 2, -1, -1]]
    assert attn_lib.image_runs(ids, 128, 64, PH).tolist() == [[-1, 1, 1, 1, 1, 1, -1, -1]]
    torch.manual_seed(0)
    plain = FusionModel(config(image_bidirectional=True))
    with_id = FusionModel(config(image_bidirectional=True, image_placeholder_id=PH))
    with_id.load_state_dict(plain.state_dict())
    codes_only = torch.tensor([[BOS, 20, 130, 131, 132, EOS, 21, 22]])
    with torch.no_grad():
        assert torch.equal(plain(codes_only), with_id(codes_only))
        assert not torch.equal(plain(ids), with_id(ids))  # the placeholders join the image run


# ---- through the Lightning module -------------------------------------------------------------------------------


def module_for_fit():
    from fusion_model.training.lightning_module import FusionLightningModule

    torch.manual_seed(0)
    return FusionLightningModule(config(), family="transfusion", family_options={**OPTIONS, "caption_dropout": 0.5},
                                 lr=1e-3, warmup_steps=1)


def fit(batches: list[dict], accumulate: int, steps: int) -> dict[str, torch.Tensor]:
    module = module_for_fit()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, accumulate_grad_batches=accumulate)
    batches = list(with_window_denominators(batches, accumulate, module.window_denominators))
    trainer.fit(module, torch.utils.data.DataLoader(batches, batch_size=None))
    assert trainer.global_step == steps
    metrics = trainer.callback_metrics
    assert {"train/text", "train/diffusion", "train/diffusion_mse"} <= set(metrics)
    assert all(math.isfinite(float(metrics[name])) for name in ("train/text", "train/diffusion"))
    return {name: value.detach().clone() for name, value in module.state_dict().items()}


def test_two_steps_through_the_lightning_module_accumulate_exactly():
    one, two, three, four = documents()
    big = [pack([[one, four], [two], [three], [four, two]], 28), pack([[two, one], [three], [four], [one]], 28)]
    small = [pack([[one, four], [two]], 28), pack([[three], [four, two]], 28),
             pack([[two, one], [three]], 28), pack([[four], [one]], 28)]
    initial = module_for_fit().state_dict()
    expected, got = fit(big, accumulate=1, steps=2), fit(small, accumulate=2, steps=2)
    assert any(name.startswith("patches.") for name in expected)
    for name in ("patches.patch_in.weight", "patches.time.mlp.0.weight", "patches.patch_out.weight",
                 "model.layers.0.attn.qkv.weight"):
        assert not torch.equal(expected[name], initial[name]), name
    # summation order differs, and Adam turns that into ~1e-6 differences; one count for both terms, or a mean per
    # micro-batch, moves the weights by far more
    for name, weight in expected.items():
        torch.testing.assert_close(got[name], weight, rtol=0, atol=1e-5, msg=name)


def test_a_checkpoint_loads_back_as_the_family_with_its_decoder_config_and_weights(tmp_path):
    from fusion_model.families.loading import load_family

    module = module_for_fit()
    torch.save({"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams)}, tmp_path / "t.ckpt")
    loaded = load_family(tmp_path / "t.ckpt")
    assert isinstance(loaded.family, TransfusionFamily) and loaded.family.options == module.family.options
    assert loaded.parts["model"].config == module.parts["model"].config  # placeholder id and bidirectional included
    ids = torch.tensor([[BOS, 20, BOI, PH, PH, PH, PH]])
    noisy = torch.randn(1, 7, D)
    with torch.no_grad():
        for part in module.parts.values():
            part.eval()
        torch.testing.assert_close(loaded.family.denoise(loaded.parts, ids, noisy, 10),
                                   module.family.denoise(module.parts, ids, noisy, 10), rtol=0, atol=0)
