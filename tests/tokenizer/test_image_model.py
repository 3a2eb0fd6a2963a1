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


@pytest.mark.parametrize("preset, side", [("demo-64", 4), ("small-128", 8)])
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
    improved = ImageTokenizerConfig.from_preset("demo-64", quantizer="improved")
    assert (improved.embed_dim, improved.kmeans_init, improved.dead_code_threshold) == (8, True, 2.0)
    chameleon = ImageTokenizerConfig.from_preset("demo-64", quantizer="chameleon")
    assert (chameleon.embed_dim, chameleon.kmeans_init) == (chameleon.latent_channels, False)
