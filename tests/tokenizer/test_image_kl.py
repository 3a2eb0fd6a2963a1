"""The continuous (KL) image tokenizer: latent shapes, a deterministic encode, the KL term against a hand computation,
gradient reach, training, the bundle round trip and its kind, `train.py tokenizer fit` with the kl-demo-64 config."""

import csv
import json
from pathlib import Path

import lightning as L
import pytest
import torch
from torch.distributions import Normal, kl_divergence

from fusion_model import cli
from fusion_model.cli.tokenizer import main
from tokenizer.image import (
    ContinuousImageTokenizer,
    ImageTokenizer,
    ImageTokenizerConfig,
    build_image_tokenizer,
    load_image_tokenizer,
)
from tokenizer.image.continuous import LOGVAR_RANGE
from tokenizer.image.lightning import ImageTokenizerModule
from tokenizer.image.losses import gaussian_kl
from tokenizer.image.train import fit_image_tokenizer

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "tokenizer"


def _config(**overrides) -> ImageTokenizerConfig:
    fields = dict(image_size=32, base_channels=8, channel_multiplier=(1, 2, 2), num_res_blocks=1, latent_channels=16,
                  norm_groups=4, bottleneck="kl", embed_dim=4)
    return ImageTokenizerConfig(**{**fields, **overrides})


def _tiny(**overrides) -> ContinuousImageTokenizer:
    torch.manual_seed(0)
    return ContinuousImageTokenizer(_config(**overrides))


def _pixels(n: int = 3, size: int = 32, seed: int = 1) -> torch.Tensor:
    return torch.rand(n, 3, size, size, generator=torch.Generator().manual_seed(seed)) * 2 - 1


def test_latents_have_the_configured_channels_and_grid():
    tokenizer = _tiny().eval()
    latents = tokenizer.encode(_pixels())
    assert latents.shape == (3, 4, 8, 8) and latents.dtype == torch.float32
    assert tokenizer.kind == "continuous" and tokenizer.latent_channels == 4 and tokenizer.downsample_factor == 4
    assert tokenizer.latent_grid() == (8, 8) and tokenizer.latent_grid(16) == (4, 4)
    assert tokenizer.latent_grid((16, 24)) == (4, 6)
    assert tokenizer.encode(_pixels(2, 16)).shape == (2, 4, 4, 4)  # any multiple of the downsampling factor
    assert tokenizer.decode(latents).shape == (3, 3, 32, 32) and tokenizer.decode(latents).abs().max() <= 1
    assert tokenizer.encode(_pixels()[0]).shape == (1, 4, 8, 8)  # one (3, H, W) image
    assert tokenizer.encode(_pixels(0)).shape == (0, 4, 8, 8) and tokenizer.decode(latents[:0]).shape == (0, 3, 32, 32)
    with pytest.raises(ValueError, match="multiple of the downsampling factor 4"):
        tokenizer.latent_grid(30)


def test_presets_give_16_patches_per_digit_and_transfusions_latents():
    demo = ImageTokenizerConfig.from_preset("kl-demo-64")
    vq_demo = ImageTokenizerConfig.from_preset("demo-64")
    # the same grid as demo-64's codes: 16 patches of 1x1 per 64-px digit, each 8 numbers
    assert demo.grid_shape == vq_demo.grid_shape == (4, 4) and demo.embed_dim == 8
    tokenizer = build_image_tokenizer(demo)
    assert isinstance(tokenizer, ContinuousImageTokenizer) and tokenizer.latent_channels == 8
    assert tokenizer.encode(_pixels(1, 64)).shape == (1, 8, 4, 4)
    # encoder and decoder are demo-64's: the parameters differ only in quant_conv (2 x 8 outputs: mean, log-variance)
    # and post_quant_conv (8 inputs), against the codebook's 32 dimensions
    vq = ImageTokenizer(vq_demo)
    for name in ("encoder", "decoder"):
        assert [p.shape for p in getattr(vq, name).parameters()] == [p.shape for p in getattr(tokenizer, name).parameters()]
    assert tokenizer.quant_conv.weight.shape == (16, 32, 1, 1) and tokenizer.post_quant_conv.weight.shape == (32, 8, 1, 1)
    with torch.device("meta"):
        f8 = build_image_tokenizer(ImageTokenizerConfig.from_preset("kl-f8"))
    assert f8.latent_channels == 8 and f8.downsample_factor == 8 and f8.latent_grid(256) == (32, 32)
    assert 80e6 < sum(p.numel() for p in f8.parameters()) < 90e6  # LDM's kl-f8 has 83.7M


def test_encode_is_the_scaled_posterior_mean_in_either_mode_and_decode_inverts_the_scale():
    tokenizer = _tiny()
    tokenizer.latent_scale.fill_(2.5)
    pixels = _pixels()
    tokenizer.train()  # encode must not sample even when the module is in training mode
    first, second = tokenizer.encode(pixels), tokenizer.encode(pixels)
    assert torch.equal(first, second)
    with torch.no_grad():
        mean, logvar = tokenizer.posterior(pixels)
        sampled = tokenizer(pixels)  # training mode: a reparameterised sample
        tokenizer.eval()
        out = tokenizer(pixels)
    torch.testing.assert_close(first, mean * 2.5)
    assert not torch.allclose(sampled.latents, sampled.mean) and torch.equal(out.latents, out.mean)
    torch.testing.assert_close(tokenizer.decode(first), out.reconstruction.clamp(-1, 1))
    assert logvar.min() >= LOGVAR_RANGE[0] and logvar.max() <= LOGVAR_RANGE[1]
    # decode takes the float16 latents that token shards store
    torch.testing.assert_close(tokenizer.decode(first.half()), tokenizer.decode(first.half().float()))


def test_kl_equals_a_hand_computation_and_the_training_loss_adds_it_at_kl_weight_per_pixel():
    mean, logvar = torch.randn(2, 4, 3, 3), torch.randn(2, 4, 3, 3)
    by_hand = torch.stack([sum(0.5 * (m * m + v.exp() - 1 - v) for m, v in zip(mean[b].flatten(), logvar[b].flatten()))
                           for b in range(2)])
    torch.testing.assert_close(gaussian_kl(mean, logvar), by_hand)
    reference = kl_divergence(Normal(mean, (0.5 * logvar).exp()), Normal(0.0, 1.0)).flatten(1).sum(1)
    torch.testing.assert_close(gaussian_kl(mean, logvar), reference)
    assert gaussian_kl(torch.zeros(1, 4, 2, 2), torch.zeros(1, 4, 2, 2)).item() == 0.0

    # the logged loss of one step: recon + kl_weight * KL / (3 H W), with KL in nats per image
    L.seed_everything(0)
    module = ImageTokenizerModule(preset="kl-demo-64", overrides={"image_size": 32}, kl_weight=0.5, scale_images=0)
    trainer = L.Trainer(max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, accelerator="cpu", limit_val_batches=0)
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(_pixels(4), batch_size=4))
    logged = trainer.callback_metrics
    assert float(logged["train/kl"]) > 0
    expected = logged["train/recon"] + 0.5 * logged["train/kl"] / (3 * 32 * 32)
    torch.testing.assert_close(logged["train/loss"], expected)
    assert {"train/latent_mean", "train/latent_std", "train/posterior_std", "train/psnr"} <= set(logged)


def test_gradient_reaches_every_parameter_of_encoder_bottleneck_and_decoder():
    tokenizer = _tiny().train()
    pixels = _pixels(2)
    out = tokenizer(pixels)
    ((out.reconstruction - pixels) ** 2).mean().backward()  # the log-variance gets gradient through the sample alone
    missing = [name for name, p in tokenizer.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not missing
    assert tokenizer.quant_conv.weight.grad[4:].abs().sum() > 0  # the log-variance half


def test_a_few_training_steps_lower_the_reconstruction_error_on_a_fixed_batch():
    images = torch.nn.functional.interpolate(_pixels(8, 8), size=32, mode="nearest")  # learnable blocky images
    L.seed_everything(3)
    untrained = ImageTokenizerModule(preset="kl-demo-64", overrides={"image_size": 32}).tokenizer.eval()
    with torch.no_grad():
        before = ((untrained.decode(untrained.encode(images)) - images) ** 2).mean()
    tokenizer, info = fit_image_tokenizer(images, preset="kl-demo-64", overrides={"image_size": 32}, batch_size=8,
                                          max_steps=20, seed=3, progress=False, warmup_steps=1)
    after = ((tokenizer.decode(tokenizer.encode(images)) - images) ** 2).mean()
    assert info["steps"] == 20 and float(after) < 0.7 * float(before)
    assert {"train_kl", "train_latent_std", "train_psnr", "latent_scale"} <= set(info)
    assert "train_vq" not in info  # no codebook


def test_latent_scale_is_one_over_the_std_of_the_posterior_means_measured_on_up_to_max_images():
    module = ImageTokenizerModule(preset="kl-demo-64", overrides={"image_size": 32})
    batches = [_pixels(4, seed=1), _pixels(4, seed=2), _pixels(4, seed=3)]
    with torch.no_grad():
        means = module.tokenizer.posterior(torch.cat(batches)[:6])[0]
    assert module.measure_latent_scale(batches, max_images=6) == pytest.approx(float(1 / means.std()), rel=1e-5)
    latents = module.tokenizer.encode(torch.cat(batches)[:6])
    assert float(latents.std()) == pytest.approx(1.0, rel=1e-4)
    assert module.measure_latent_scale([], max_images=6) is None  # no images: unchanged


def test_training_keeps_a_running_latent_scale_so_a_mid_run_checkpoint_has_one():
    L.seed_everything(0)
    module = ImageTokenizerModule(preset="kl-demo-64", overrides={"image_size": 32}, scale_images=0)
    batch = _pixels(4)
    with torch.no_grad():
        first = 1 / module.tokenizer.posterior(batch)[0].std()  # the first step's estimate is its batch alone
    trainer = L.Trainer(max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, accelerator="cpu", limit_val_batches=0)
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(batch, batch_size=4))
    assert float(module.tokenizer.latent_scale) == pytest.approx(float(first), rel=1e-5)


def test_bundle_round_trip_keeps_latents_reconstructions_and_fingerprint_and_says_its_kind(tmp_path):
    tokenizer = _tiny().eval()
    tokenizer.latent_scale.fill_(0.37)
    with torch.no_grad():
        tokenizer.decoder.conv_out.bias.add_(0.1)
    pixels = _pixels()
    tokenizer.save_pretrained(tmp_path / "kl")
    assert json.loads((tmp_path / "kl" / "config.json").read_text())["bottleneck"] == "kl"
    for loaded in (ContinuousImageTokenizer.from_pretrained(tmp_path / "kl"), load_image_tokenizer(tmp_path / "kl")):
        assert isinstance(loaded, ContinuousImageTokenizer) and loaded.kind == "continuous" and not loaded.training
        assert loaded.config == tokenizer.config and loaded.fingerprint() == tokenizer.fingerprint()
        assert float(loaded.latent_scale) == pytest.approx(0.37)
        latents = loaded.encode(pixels)
        assert torch.equal(latents, tokenizer.encode(pixels))
        assert torch.equal(loaded.decode(latents), tokenizer.decode(latents))
    with torch.no_grad():
        tokenizer.latent_scale.fill_(0.38)
    assert tokenizer.fingerprint() != loaded.fingerprint()  # the scale is part of what the fingerprint covers

    # the VQ loader refuses it in one sentence, and the continuous one refuses a VQ bundle the same way
    vq = ImageTokenizer(ImageTokenizerConfig(image_size=32, base_channels=8, channel_multiplier=(1, 2, 2),
                                             num_res_blocks=1, latent_channels=16, norm_groups=4, codebook_size=16))
    vq.save_pretrained(tmp_path / "vq")
    assert "bottleneck" not in json.loads((tmp_path / "vq" / "config.json").read_text())  # VQ bundles as before
    assert load_image_tokenizer(tmp_path / "vq").kind == ImageTokenizer.kind == "vq"
    with pytest.raises(ValueError, match="is a continuous image tokenizer bundle .* but a vq one") as refused:
        ImageTokenizer.from_pretrained(tmp_path / "kl")
    assert "\n" not in str(refused.value) and "demo-64" in str(refused.value)
    with pytest.raises(ValueError, match="is a vq image tokenizer bundle .* but a continuous one") as refused:
        ContinuousImageTokenizer.from_pretrained(tmp_path / "vq")
    assert "\n" not in str(refused.value) and "kl-demo-64" in str(refused.value)
    with pytest.raises(ValueError, match="bottleneck 'vq'"):
        ImageTokenizer(_config())


def test_bad_latents_and_configs_get_one_line_errors():
    tokenizer = _tiny().eval()
    cases = [
        (torch.zeros(2, 3, 8, 8), r"shape \(B, 4, h, w\) .* got \(2, 3, 8, 8\)"),  # channels disagree
        (torch.zeros(2, 4, 8), r"got \(2, 4, 8\)"),
        (torch.zeros(4, 4, 8, 8, 1), r"got \(4, 4, 8, 8, 1\)"),
        (torch.zeros(1, 4, 0, 8), r"h, w >= 1"),
        (torch.zeros(1, 4, 8, 8, dtype=torch.long), "integer codes belong to a VQ image tokenizer"),
        (torch.full((1, 4, 8, 8), float("nan")), "NaN or infinite"),
    ]
    for latents, message in cases:
        with pytest.raises(ValueError, match=message) as error:
            tokenizer.decode(latents)
        assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match=r"\[-1, 1\]"):
        tokenizer.encode(torch.rand(1, 3, 32, 32) * 255)
    with pytest.raises(ValueError, match="bottleneck must be one of"):
        _config(bottleneck="gaussian")


def test_cli_fits_the_kl_demo_config_end_to_end_logs_latent_statistics_and_exports(tmp_path, capsys):
    root = tmp_path / "run"
    common = ["fit", "--config", str(CONFIGS / "kl-demo-64.yaml"), "--data.batch_size", "4", "--data.val_samples", "4",
              "--trainer.accelerator", "cpu", "--trainer.enable_progress_bar", "false", "--threads", "1"]
    assert main([*common, "--trainer.max_steps", "2", "--trainer.val_check_interval", "2",
                 "--trainer.log_every_n_steps", "1", "--trainer.default_root_dir", str(root),
                 "--model.scale_images", "8"]) == 0
    printed = capsys.readouterr().out
    assert "continuous image tokenizer bundle (8 latent channels, latent_scale" in printed
    bundle = load_image_tokenizer(root / "tokenizer")
    assert bundle.kind == "continuous" and bundle.latent_grid(64) == (4, 4)
    assert float(bundle.latent_scale) != 1.0 and torch.isfinite(bundle.latent_scale)  # measured at the end of fit
    rows = list(csv.DictReader((root / "csv" / "version_0" / "metrics.csv").open()))
    logged = {key for row in rows for key, value in row.items() if value}
    assert {"val/psnr", "val/recon", "val/kl", "val/latent_mean", "val/latent_std", "train/kl"} <= logged
    assert "val/usage" not in logged
    assert list((root / "tb" / "version_0" / "images").glob("*.png"))
    # the checkpoint exports the same weights; its latent_scale is the running estimate, not the final measurement
    checkpoint = next((root / "checkpoints").glob("*.ckpt"))
    assert main(["export", "--checkpoint", str(checkpoint), "--out", str(tmp_path / "exported")]) == 0
    assert "continuous image tokenizer bundle" in capsys.readouterr().out
    exported = load_image_tokenizer(tmp_path / "exported")
    assert exported.kind == "continuous"
    for (name, a), (_, b) in zip(sorted(bundle.state_dict().items()), sorted(exported.state_dict().items())):
        assert name == "latent_scale" or torch.equal(a, b), name
    assert float(exported.latent_scale) == pytest.approx(float(bundle.latent_scale), rel=0.5)

    # bad input: one line on stderr, exit 2
    assert cli.main(["tokenizer", *common, "--trainer.max_steps", "1", "--trainer.default_root_dir",
                     str(tmp_path / "bad"), "--model.overrides", "{bottleneck: gaussian}"]) == 2
    err = capsys.readouterr().err
    assert "bottleneck must be one of" in err and err.count("\n") == 1
