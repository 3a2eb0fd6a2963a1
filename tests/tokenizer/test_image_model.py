"""The VQGAN's invariants, checked before any training: shape, parameter count and equivalence against
transformers' ChameleonVQVAE, gradient reach through the straight-through estimator, batch independence."""

import pytest
import torch
from transformers import ChameleonVQVAEConfig
from transformers.models.chameleon.modeling_chameleon import ChameleonVQVAE

from tokenizer.image import ImageTokenizer, ImageTokenizerConfig


def _count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def test_chameleon_preset_maps_512px_to_32x32_codes_below_8192():
    tokenizer = ImageTokenizer(ImageTokenizerConfig.from_preset("chameleon")).eval()
    assert tokenizer.grid_shape == (32, 32) and tokenizer.config.codebook_size == 8192
    # the 29M-parameter encoder runs on the meta device (shapes only: ~0.5 TFLOP per 512-px image on a CPU)
    meta = ImageTokenizer(ImageTokenizerConfig.from_preset("chameleon")).to("meta")
    latents = meta.encode_latents(torch.empty(2, 3, 512, 512, device="meta"))
    assert latents.shape == (2, 256, 32, 32)
    # the real quantizer on latents of that shape
    codes = tokenizer.quantize_codes(torch.randn(2, 256, 32, 32))
    assert codes.shape == (2, 32, 32) and codes.dtype == torch.long
    assert 0 <= int(codes.min()) and int(codes.max()) < 8192


@pytest.mark.parametrize("preset, side", [("demo-64", 4), ("photos-64", 8), ("small-128", 8)])
def test_small_presets_encode_and_decode_at_their_sizes(preset, side):
    tokenizer = ImageTokenizer(ImageTokenizerConfig.from_preset(preset)).eval()
    size = tokenizer.config.image_size
    codes = tokenizer.encode(torch.rand(1, 3, size, size) * 2 - 1)
    assert tokenizer.grid_shape == (side, side) and codes.shape == (1, side, side)
    assert int(codes.max()) < tokenizer.config.codebook_size
    images = tokenizer.decode(codes)
    assert images.shape == (1, 3, size, size) and images.abs().max() <= 1


def test_demo_preset_is_about_one_million_parameters():
    assert 0.5e6 < _count(ImageTokenizer(ImageTokenizerConfig.from_preset("demo-64"))) < 1.5e6


def test_chameleon_preset_parameter_count_equals_transformers_chameleon_vqvae():
    with torch.device("meta"):
        reference = ChameleonVQVAE(ChameleonVQVAEConfig())
        ours = ImageTokenizer(ImageTokenizerConfig.from_preset("chameleon"))
    # transformers' VQVAE = encoder + quant_conv + codebook (nn.Embedding) + post_quant_conv; our codebook is
    # an EMA buffer (updated without gradients), so it is counted by its size.
    ours_total = (
        _count(ours.encoder)
        + _count(ours.quant_conv)
        + ours.quantize.codebook.numel()
        + _count(ours.post_quant_conv)
    )
    assert ours_total == _count(reference)
    assert _count(ours.encoder) == _count(reference.encoder)
    assert ours.quantize.codebook.shape == reference.quantize.embedding.weight.shape == (8192, 256)


def _tiny(quantizer: str) -> ImageTokenizerConfig:
    """32 px, 3 levels, attention at 16 px in the down and up paths: every kind of module, quickly."""
    return ImageTokenizerConfig(image_size=32, base_channels=16, channel_multiplier=(1, 2, 2), num_res_blocks=1,
                                attn_resolutions=(16,), latent_channels=16, norm_groups=8, codebook_size=32,
                                quantizer=quantizer)


def _random_reference() -> ChameleonVQVAE:
    """A small randomly initialised ChameleonVQVAE with attention in the down path, GroupNorm/bias perturbed."""
    config = ChameleonVQVAEConfig(
        resolution=32,
        base_channels=32,
        channel_multiplier=[1, 2, 2],
        num_res_blocks=2,
        attn_resolutions=[16],
        latent_channels=32,
        embed_dim=16,
        num_embeddings=64,
    )
    reference = ChameleonVQVAE(config).eval()
    with (
        torch.no_grad()
    ):  # the default init leaves GroupNorm at 1/0 and biases at 0: make every weight matter
        for p in reference.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return reference


def test_weights_from_transformers_give_the_same_latents_and_codes():
    reference = _random_reference()
    ours = ImageTokenizer.from_transformers(reference)
    pixels = torch.rand(3, 3, 32, 32) * 2 - 1
    with torch.no_grad():
        expected = reference.encode(pixels)
        latents = ours.encode_latents(pixels)
        torch.testing.assert_close(ours.encoder(pixels), expected.last_hidden_state)
        torch.testing.assert_close(latents, reference.quant_conv(expected.last_hidden_state))
    codes = ours.encode(pixels)
    assert torch.equal(codes.flatten(), expected.image_tokens)
    torch.testing.assert_close(ours.quantize.codebook, reference.quantize.embedding.weight)


@pytest.mark.parametrize("mode", ["chameleon", "improved"])
def test_reconstruction_gradient_reaches_every_encoder_and_decoder_parameter(mode):
    tokenizer = ImageTokenizer(_tiny(mode)).train()
    assert any(".attn." in n for n, _ in tokenizer.named_parameters())
    pixels = torch.rand(2, 3, 32, 32) * 2 - 1
    out = tokenizer(pixels)
    (out.reconstruction - pixels).abs().mean().backward()  # reconstruction only: the STE must carry it
    names = [n for n, p in tokenizer.named_parameters()]
    assert names and all(
        n.startswith(("encoder.", "quant_conv.", "post_quant_conv.", "decoder.")) for n in names
    )
    dead = [n for n, p in tokenizer.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not dead, f"no gradient reached {dead}"


def test_encoding_is_batch_independent_in_eval_mode():
    tokenizer = ImageTokenizer(_tiny("chameleon")).eval()
    pixels = torch.rand(5, 3, 32, 32) * 2 - 1
    with torch.no_grad():
        together = tokenizer.encode_latents(pixels)
        alone = tokenizer.encode_latents(pixels[2:3])
    torch.testing.assert_close(together[2:3], alone, rtol=1e-5, atol=1e-5)


def test_config_rejects_unknown_modes_presets_and_keys():
    with pytest.raises(ValueError, match="quantizer"):
        ImageTokenizerConfig(quantizer="fancy")
    with pytest.raises(ValueError, match="unknown image tokenizer preset"):
        ImageTokenizerConfig.from_preset("huge")
    with pytest.raises(ValueError, match="unknown image tokenizer config keys"):
        ImageTokenizerConfig.from_dict({"image_sise": 64})
    with pytest.raises(ValueError, match="divisible"):
        ImageTokenizerConfig(image_size=100)
    improved = ImageTokenizerConfig.from_preset("chameleon", quantizer="improved")
    assert (improved.embed_dim, improved.kmeans_init, improved.dead_code_threshold) == (8, True, 2.0)
    chameleon = ImageTokenizerConfig.from_preset("chameleon")
    assert (chameleon.embed_dim, chameleon.kmeans_init) == (chameleon.latent_channels, False)


def _light(resample: str) -> ImageTokenizerConfig:
    """A CPU-preset shape: no res-blocks at the two highest resolutions (their resampling convs change width)."""
    return ImageTokenizerConfig(image_size=32, base_channels=8, channel_multiplier=(1, 2, 4, 4),
                                num_res_blocks=(0, 0, 1, 1), decoder_res_blocks=(0, 0, 1, 2), latent_channels=16,
                                norm_groups=4, codebook_size=32, resample=resample)


@pytest.mark.parametrize("resample", ["vqgan", "strided"])
def test_levels_without_blocks_still_encode_decode_and_train_every_parameter(resample):
    tokenizer = ImageTokenizer(_light(resample)).train()
    assert len(tokenizer.encoder.down[0].block) == 0 and len(tokenizer.decoder.up[3].block) == 2
    pixels = torch.rand(2, 3, 32, 32) * 2 - 1
    out = tokenizer(pixels)
    assert out.codes.shape == (2, 4, 4) and out.reconstruction.shape == pixels.shape
    (out.reconstruction - pixels).pow(2).mean().backward()
    dead = [n for n, p in tokenizer.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not dead, f"no gradient reached {dead}"


def test_strided_resampling_is_a_4x4_stride_2_conv_and_transposed_conv():
    tokenizer = ImageTokenizer(_light("strided"))
    down, up = tokenizer.encoder.down[0].downsample.conv, tokenizer.decoder.up[1].upsample.conv
    assert isinstance(up, torch.nn.ConvTranspose2d)
    assert (down.kernel_size, down.stride, up.kernel_size, up.stride) == ((4, 4), (2, 2), (4, 4), (2, 2))
    # widths move in the resampling convs of the block-less levels: 8 -> 8 -> 16 down, 16 -> 8 up
    assert (down.in_channels, down.out_channels) == (8, 8)
    assert (up.in_channels, up.out_channels) == (16, 8)
    vqgan = ImageTokenizer(_light("vqgan"))
    assert vqgan.decoder.up[1].upsample.conv.kernel_size == (3, 3)


def test_one_block_count_means_every_level_and_decoders_get_one_more():
    config = ImageTokenizerConfig(channel_multiplier=(1, 2, 2), image_size=64, num_res_blocks=2)
    assert config.encoder_blocks == (2, 2, 2) and config.decoder_blocks == (3, 3, 3)
    config = ImageTokenizerConfig(channel_multiplier=(1, 2, 2), image_size=64, num_res_blocks=[1, 0, 2])
    assert config.num_res_blocks == (1, 0, 2) and config.decoder_blocks == (2, 1, 3)


def test_fields_added_later_leave_older_configs_and_fingerprints_unchanged():
    plain = ImageTokenizerConfig.from_preset("chameleon").to_dict()
    assert "decoder_res_blocks" not in plain and "resample" not in plain  # fingerprints hash this JSON
    light = _light("strided")
    assert ImageTokenizerConfig.from_dict(light.to_dict()) == light
    assert light.to_dict()["resample"] == "strided" and light.to_dict()["decoder_res_blocks"] == [0, 0, 1, 2]


def test_only_the_chameleon_layout_counts_as_transformers_compatible():
    assert ImageTokenizerConfig.from_preset("chameleon").chameleon_layout
    for change in ({"num_res_blocks": (2, 2, 2, 2, 1)}, {"resample": "strided"}, {"quantizer": "improved"}):
        assert not ImageTokenizerConfig.from_preset("chameleon", **change).chameleon_layout, change


def test_config_rejects_bad_block_counts_and_resampling():
    with pytest.raises(ValueError, match="resample"):
        ImageTokenizerConfig(resample="pixelshuffle")
    with pytest.raises(ValueError, match="one per level"):
        ImageTokenizerConfig(num_res_blocks=(1, 1))
    with pytest.raises(ValueError, match="num_res_blocks must be >= 0"):
        ImageTokenizerConfig(num_res_blocks=-1)
    with pytest.raises(ValueError, match="lowest encoder level changes width"):
        ImageTokenizerConfig(image_size=64, channel_multiplier=(1, 2), num_res_blocks=(1, 0))
