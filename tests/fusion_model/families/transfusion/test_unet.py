"""The Transfusion family's U-Net patch encoder/decoder (`patch_encoder: "unet"`,
fusion_model/families/transfusion/unet.py): its options and refusals, shapes and per-image independence, the linear
default unchanged, gradient reach, `denoise` against the training forward, the sampler's cached path against the
full recompute, FLOPs against torch's counter, and a short fit through the Lightning module."""

from __future__ import annotations

import math
from dataclasses import replace

import lightning as L
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from data_shards.stream import with_window_denominators
from fusion_model.config import FusionConfig
from fusion_model.families.base import ObjectiveContext
from fusion_model.families.transfusion.family import TransfusionFamily
from fusion_model.families.transfusion.patches import LatentPatches
from fusion_model.families.transfusion.unet import UNetPatches, prime_factors
from fusion_model.model import FusionModel

PAD, BOS, EOS, BOI, EOI, PH = 0, 1, 2, 3, 4, 6  # the unified vocabulary's specials (<image> = 6)
C, K, GRID = 4, 2, (4, 6)  # a 4x6 latent grid in 2x2 patches: P = 6 patches of D = 16 values
P, D = (GRID[0] // K) * (GRID[1] // K), C * K * K
OPTIONS = dict(latent_channels=C, patch_size=K, image_placeholder_id=PH)
UNET = {**OPTIONS, "patch_encoder": "unet", "latent_grid": list(GRID), "unet_channels": 8, "unet_blocks": 1}

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: one torch thread, restored after


def config(**overrides) -> FusionConfig:
    return FusionConfig.from_preset("tiny", **{"image_offset": 128, "image_codes": 64, **overrides})


def family(options: dict | None = None) -> TransfusionFamily:
    return TransfusionFamily(config(), {**UNET, **(options or {})})


def built(fam: TransfusionFamily, seed: int = 0) -> dict[str, torch.nn.Module]:
    torch.manual_seed(seed)
    return fam.build()


def document(key: int, *segments: list[int] | int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """<s> segments </s> (a list is text, an int a number of images of P patches): ids, token keys, latents."""
    ids = [BOS]
    for segment in segments:
        ids += [BOI, *[PH] * P, EOI] * segment if isinstance(segment, int) else list(segment)
    ids = torch.tensor([*ids, EOS])
    latents = torch.zeros(len(ids), D)
    latents[ids == PH] = torch.randn(int((ids == PH).sum()), D, generator=torch.Generator().manual_seed(key))
    return ids, key * 1000 + torch.arange(len(ids)), latents


def pack(rows: list[list[tuple]], length: int = 32) -> dict[str, torch.Tensor]:
    batch = {"input_ids": torch.full((len(rows), length), PAD), "document_ids": torch.full((len(rows), length), -1),
             "position_ids": torch.zeros(len(rows), length, dtype=torch.long),
             "token_keys": torch.full((len(rows), length), -1), "image_latents": torch.zeros(len(rows), length, D)}
    for r, docs in enumerate(rows):
        at = 0
        for number, (ids, keys, latents) in enumerate(docs):
            span = slice(at, at + len(ids))
            batch["input_ids"][r, span], batch["token_keys"][r, span] = ids, keys
            batch["document_ids"][r, span], batch["position_ids"][r, span] = number, torch.arange(len(ids))
            batch["image_latents"][r, span] = latents
            at += len(ids)
        assert at <= length
    return batch


def a_batch() -> dict[str, torch.Tensor]:
    """Caption then image; image then caption; two images around a word; text only."""
    one, two = document(1, [20, 21, 22], 1), document(2, 1, [30, 31])
    three, four = document(3, [40], 1, [41], 1, [42]), document(4, [50, 51, 52, 53])
    return pack([[one, four], [two, four], [three]], 24)


# ---- options ------------------------------------------------------------------------------------------------------


def test_the_options_default_to_linear_and_refuse_bad_values_in_one_sentence():
    linear = TransfusionFamily(config(), OPTIONS).options
    assert (linear.patch_encoder, linear.latent_grid, linear.unet_channels, linear.unet_blocks) == (
        "linear", None, 64, 2)
    assert family().options.latent_grid == GRID  # a list from the command line or YAML, kept as a tuple
    for name, value, rule in [("patch_encoder", "conv", '"linear" or "unet"'),
                              ("latent_grid", [4, 5], "patch_size 2 must divide"),
                              ("latent_grid", [4], "two positive integers"),
                              ("latent_grid", [4, 0], "two positive integers"),
                              ("unet_channels", 0, "positive integer"), ("unet_blocks", 1.5, "positive integer")]:
        with pytest.raises(ValueError, match=rf"family_options\.{name}=.*{rule}") as error:
            family({name: value})
        assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match="U-Net patch encoder needs model.family_options latent_grid"):
        TransfusionFamily(config(), {**OPTIONS, "patch_encoder": "unet"})


def test_derive_options_takes_the_latent_grid_from_the_manifest_only_for_the_unet():
    manifest = {"latent": {"channels": 8, "grid": [32, 16], "patch_size": 2}, "image_placeholder_id": 6}
    options = {"patch_encoder": "unet"}
    TransfusionFamily.derive_options(options, manifest, None)
    assert options == {"patch_encoder": "unet", "latent_channels": 8, "patch_size": 2, "image_placeholder_id": 6,
                       "latent_grid": [32, 16]}
    options = {}
    TransfusionFamily.derive_options(options, manifest, None)
    assert "latent_grid" not in options  # the linear default's options (and checkpoints) stay as they were
    options = {"patch_encoder": "unet", "latent_grid": [8, 8]}
    TransfusionFamily.derive_options(options, manifest, None)
    assert options["latent_grid"] == [8, 8]  # a given grid wins


def test_the_linear_default_builds_the_same_parts_from_the_same_seed():
    default, explicit = built(TransfusionFamily(config(), OPTIONS)), built(
        TransfusionFamily(config(), {**OPTIONS, "patch_encoder": "linear"}))
    torch.manual_seed(0)
    reference = {"model": FusionModel(replace(config(), image_placeholder_id=PH, image_bidirectional=True)),
                 "patches": LatentPatches(D, 64, config().init_std)}
    for parts in (default, explicit):
        assert isinstance(parts["patches"], LatentPatches)
        for name, part in reference.items():
            expected, got = part.state_dict(), parts[name].state_dict()
            assert expected.keys() == got.keys()
            assert all(torch.equal(got[key], expected[key]) for key in expected), name


# ---- the module ---------------------------------------------------------------------------------------------------


def test_prime_factors_give_the_downsampling_steps():
    assert [prime_factors(k) for k in (1, 2, 4, 6, 8)] == [[], [2], [2, 2], [2, 3], [2, 2, 2]]


@pytest.mark.parametrize("patch_size, grid", [(1, (3, 2)), (2, (4, 6)), (4, (8, 4))])
def test_shapes_and_each_image_is_its_own(patch_size, grid):
    torch.manual_seed(0)
    from fusion_model.families.transfusion.patches import TimestepEmbedding

    unet = UNetPatches(C, patch_size, grid, 32, 0.02, time=TimestepEmbedding(32), time_dim=32, channels=8, blocks=2)
    per, dim = unet.patches_per_image, C * patch_size ** 2
    assert per == (grid[0] // patch_size) * (grid[1] // patch_size)
    assert len(unet.down) == len(unet.up) == len(prime_factors(patch_size)) + 1
    noisy, steps = torch.randn(3 * per, dim), torch.tensor([5] * per + [600] * per + [999] * per)
    embedded = unet.embed(noisy, steps)
    assert embedded.shape == (3 * per, 32)
    hidden = torch.randn(3 * per, 32)
    out = unet(hidden)
    assert out.shape == (3 * per, dim)
    # changing the middle image's input (or its step) changes only its own rows, at the input and the output (its
    # skips); changing its decoder outputs changes only its own predicted noise
    one_cell, earlier = noisy.clone(), steps.clone()
    one_cell[per + per // 2] += 1.0
    earlier[per:2 * per] -= 300
    for changed_noisy, changed_steps in [(one_cell, steps), (noisy, earlier)]:
        embedded_changed = unet.embed(changed_noisy, changed_steps)
        out_changed = unet(hidden)
        for rows, same in [(slice(0, per), True), (slice(per, 2 * per), False), (slice(2 * per, None), True)]:
            assert torch.equal(embedded_changed[rows], embedded[rows]) == same
            assert torch.equal(out_changed[rows], out[rows]) == same
    unet.embed(noisy, steps)
    changed_hidden = hidden.clone()
    changed_hidden[2 * per] += 1.0
    out_changed = unet(changed_hidden)
    assert torch.equal(out_changed[: 2 * per], out[: 2 * per]) and not torch.equal(out_changed, out)


def test_the_decoder_vector_of_a_patch_is_that_patch_in_row_major_order():
    """With every ResNet block reduced to its shortcut, the 3x3 convolutions to their centre tap and the output
    norm removed, each patch's vector depends on that patch's latents alone and its noise on its vector alone:
    then a change at patch j moves row j only, at the input and at the output."""
    unet = built(family({"unet_blocks": 2}))["patches"]
    with torch.no_grad():
        for module in unet.modules():
            if hasattr(module, "conv2"):
                module.conv2.weight.zero_()
                module.conv2.bias.zero_()
            elif isinstance(module, torch.nn.Conv2d) and module.kernel_size == (3, 3):
                centre = module.weight[:, :, 1, 1].clone()
                module.weight.zero_()
                module.weight[:, :, 1, 1] = centre
    unet.norm_out = torch.nn.Identity()
    noisy, steps, hidden = torch.randn(2 * P, D), torch.full((2 * P,), 10), torch.randn(2 * P, 64)
    embedded, out = unet.embed(noisy, steps), unet(hidden)
    for j in (1, P + 4):  # row 0 column 1 of image 0; row 1 column 1 of image 1 (a 2 x 3 patch grid)
        changed = noisy.clone()
        changed[j] += 1.0
        moved = (unet.embed(changed, steps) != embedded).any(-1)
        unet(hidden)  # the skips of that call are used up
        assert moved.nonzero().flatten().tolist() == [j]
        changed = hidden.clone()
        changed[j] += 1.0
        unet.embed(noisy, steps)
        assert (unet(changed) != out).any(-1).nonzero().flatten().tolist() == [j]


def test_calls_out_of_order_or_on_cut_images_are_refused():
    unet = built(family())["patches"]
    with pytest.raises(ValueError, match=r"got 5 patch vectors, not whole images of 6 patches .*must not be cut"):
        unet.embed(torch.randn(5, D), torch.zeros(5, dtype=torch.long))
    with pytest.raises(RuntimeError, match="needs the skip activations of an embed call"):
        unet(torch.randn(P, 64))
    unet.embed(torch.randn(2 * P, D), torch.zeros(2 * P, dtype=torch.long))
    with pytest.raises(RuntimeError, match=f"got {P} positions, its embed call {2 * P}"):
        unet(torch.randn(P, 64))
    with pytest.raises(RuntimeError, match="needs the skip activations"):  # a refused call used them up too
        unet(torch.randn(2 * P, 64))


# ---- in the family --------------------------------------------------------------------------------------------------


def test_gradients_reach_every_unet_parameter_and_a_text_only_batch_still_gives_them():
    fam = family()
    parts = built(fam)
    assert isinstance(parts["patches"], UNetPatches)
    objective = fam.objective(parts, a_batch(), ObjectiveContext(step=1))
    assert float(objective.terms["diffusion"].count) == 4
    objective.loss(objective.counts()).backward()
    for name, part in parts.items():
        for parameter_name, p in part.named_parameters():
            assert p.grad is not None and bool(p.grad.abs().sum() > 0), f"{name}.{parameter_name}"
    for part in parts.values():
        part.zero_grad(set_to_none=True)
    objective = fam.objective(parts, pack([[document(4, [50, 51, 52, 53])]], 8), ObjectiveContext(step=1))
    objective.loss(objective.counts()).backward()
    assert all(p.grad is not None for p in parts["patches"].parameters())


def test_denoise_at_step_t_is_the_training_forward_at_that_step():
    fam = family({"caption_dropout": 0.0})
    parts = built(fam)
    for part in parts.values():
        part.eval()
    batch = a_batch()
    with torch.no_grad():
        draws, _, predicted = fam.training_forward(parts, batch, ObjectiveContext(step=3))
    layout, length = draws.layout, batch["input_ids"].shape[1]
    noisy = torch.zeros_like(batch["image_latents"])
    noisy[layout.is_patch] = draws.noisy
    steps = torch.zeros_like(batch["input_ids"])
    steps[layout.is_patch] = draws.timesteps[layout.patch_image()]
    assert len(set(draws.timesteps.tolist())) > 1
    image = layout.patch_image()
    for index in range(layout.count):
        # the sampler's view: the document up to the image's last patch, alone in a row of its own (an earlier
        # image of the document at its own step)
        row, start = divmod(int(layout.start[index]), length)
        first, end = start - int(batch["position_ids"][row, start]), start + P
        ids = batch["input_ids"][row : row + 1, first:end]
        with torch.no_grad():
            got = fam.denoise(parts, ids, noisy[row : row + 1, first:end], steps[row : row + 1, first:end])
        torch.testing.assert_close(got[0, start - first :], predicted[image == index], rtol=1e-4, atol=1e-5)
    # the whole batch at once, steps per position, is the training forward too
    with torch.no_grad():
        whole = fam.denoise(parts, batch["input_ids"], noisy, steps, document_ids=batch["document_ids"],
                            position_ids=batch["position_ids"])
        other = fam.denoise(parts, batch["input_ids"], noisy, steps + 100, document_ids=batch["document_ids"],
                            position_ids=batch["position_ids"])
    torch.testing.assert_close(whole[layout.is_patch], predicted, rtol=1e-4, atol=1e-5)
    assert float((other[layout.is_patch] - predicted).abs().max()) > 1e-4  # the step reaches the U-Net


def test_the_samplers_cached_path_gives_the_full_recompute_with_the_unet(tiny_tokenizers):
    from fusion_model.families.transfusion import sampling as ts
    from fusion_model.families.transfusion.sampling import DiffusionSamplingConfig
    from tokenizer.vocab import UnifiedVocab

    vocab = UnifiedVocab.load(tiny_tokenizers / "tokenizer.json")
    fam = TransfusionFamily(config(vocab_size=320, image_offset=vocab.image_offset, image_codes=16),
                            {**UNET, "image_placeholder_id": vocab.image_placeholder_id})
    parts = built(fam, seed=1)
    prompts = [ts.encode_prompt([text], vocab, None, K, D) for text in ("the cat", "one")]
    results = []
    for cache in (True, False):
        settings = DiffusionSamplingConfig(mode="image", denoising_steps=3, cfg_scale=2.0, seed=7,
                                           use_kv_cache=cache)
        results.append(ts.sample(fam, parts, vocab, prompts, settings, GRID))
    cached, full = results
    assert cached.ids == full.ids
    for got_row, expected_row in zip(cached.latents, full.latents):
        assert len(got_row) == len(expected_row) == 1 and got_row[0].shape == (C, *GRID)
        torch.testing.assert_close(got_row[0], expected_row[0], rtol=1e-4, atol=1e-4)
    # the same number of patches on another grid would run the convolutions on the wrong shape: refused
    with pytest.raises(ValueError, match=r"latent grid \(6, 4\) is not the \(4, 6\) the checkpoint's U-Net"):
        ts.sample(fam, parts, vocab, prompts, settings, (6, 4))


def test_flops_per_token_count_the_unets_matrix_products_per_patch():
    fam = family({"unet_blocks": 2})
    unet = built(fam)["patches"]
    n = 3
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        unet(unet.embed(torch.randn(n * P, D), torch.randint(0, 1000, (n * P,))))
    forward_per_patch = counter.get_total_flops() / (n * P)  # 2 x multiply-adds: convolutions, linear layers
    # what runs once per image (the timestep MLP, each block's step projection) is counted once per patch
    per_image = sum(m.weight.numel() for m in unet.modules() if isinstance(m, torch.nn.Linear))
    assert unet.matmul_parameters() == pytest.approx(forward_per_patch / 2 + per_image * (1 - 1 / P), rel=1e-9)
    assert fam.flops_per_token(128) == fam.config.flops_per_token(128) + 6.0 * unet.matmul_parameters()
    linear = TransfusionFamily(config(), OPTIONS)
    assert fam.flops_per_token(128) > linear.flops_per_token(128)


# ---- through the Lightning module -----------------------------------------------------------------------------------


def fit(batches: list[dict], accumulate: int) -> tuple[dict, dict]:
    from fusion_model.training.lightning_module import FusionLightningModule

    torch.manual_seed(0)
    module = FusionLightningModule(config(), family="transfusion", family_options={**UNET, "caption_dropout": 0.5},
                                   lr=1e-3, warmup_steps=1)
    initial = {name: value.clone() for name, value in module.state_dict().items()}
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, accumulate_grad_batches=accumulate)
    batches = list(with_window_denominators(batches, accumulate, module.window_denominators))
    trainer.fit(module, torch.utils.data.DataLoader(batches, batch_size=None))
    assert trainer.global_step == 2
    assert all(math.isfinite(float(trainer.callback_metrics[name])) for name in ("train/text", "train/diffusion"))
    return initial, {name: value.detach().clone() for name, value in module.state_dict().items()}


def test_two_steps_through_the_lightning_module_train_the_unet_and_accumulate_exactly():
    one, two = document(1, [20, 21, 22], 1), document(2, 1, [30, 31])
    three, four = document(3, [40], 1, [41], 1, [42]), document(4, [50, 51, 52, 53])
    halves = [pack([[one, four], [two]], 28), pack([[three], [four, two]], 28),
              pack([[two, one]], 28), pack([[three], [one]], 28)]
    whole = [pack([[one, four], [two], [three], [four, two]], 28), pack([[two, one], [three], [one]], 28)]
    initial, expected = fit(whole, accumulate=1)
    _, got = fit(halves, accumulate=2)
    unet_weights = [name for name in expected if name.startswith("patches.") and name.endswith("weight")]
    assert "patches.down.0.0.conv1.weight" in unet_weights and "patches.up.0.0.conv2.weight" in unet_weights
    for name in unet_weights:
        assert not torch.equal(expected[name], initial[name]), name
    for name, weight in expected.items():
        torch.testing.assert_close(got[name], weight, rtol=0, atol=1e-5, msg=name)
