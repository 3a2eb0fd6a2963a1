"""The `ImageTokenizer` API: decode(encode(x)) equals the quantizer's own output, inputs of every kind,
out-of-range codes, save/load round trip and fingerprint."""

import io

import numpy as np
import pytest
import torch
from PIL import Image

from tokenizer.image import ImageTokenizer, ImageTokenizerConfig, preprocess


def _tiny(quantizer: str = "chameleon", **overrides) -> ImageTokenizer:
    config = ImageTokenizerConfig(image_size=32, base_channels=16, channel_multiplier=(1, 2, 2), num_res_blocks=1,
                                  latent_channels=16, norm_groups=8, codebook_size=32, quantizer=quantizer, **overrides)
    return ImageTokenizer(config)


@pytest.mark.parametrize("mode", ["chameleon", "improved"])
def test_decode_of_encode_equals_the_quantizers_own_reconstruction(mode):
    tokenizer = _tiny(mode).eval()
    pixels = torch.rand(3, 3, 32, 32) * 2 - 1
    with torch.no_grad():
        tokenizer(pixels)  # first call initialises a k-means codebook (improved mode)
        out = tokenizer(pixels)
        latents = tokenizer.quantize.codes_to_latents(out.codes)
    torch.testing.assert_close(latents, tokenizer.quantize(out.latents).quantized)  # lookup == quantizer output
    codes = tokenizer.encode(pixels)
    assert torch.equal(codes, out.codes) and codes.shape == (3, 8, 8)
    torch.testing.assert_close(tokenizer.decode(codes), out.reconstruction.clamp(-1, 1))


def test_codes_are_the_nearest_codebook_vectors():
    chameleon = _tiny("chameleon").eval()
    latents = torch.randn(2, chameleon.config.embed_dim, 4, 4)
    flat = latents.permute(0, 2, 3, 1).reshape(-1, chameleon.config.embed_dim)
    euclid = torch.cdist(flat, chameleon.quantize.codebook).argmin(-1)
    assert torch.equal(chameleon.quantize_codes(latents).flatten(), euclid)

    improved = _tiny("improved").eval()
    improved.quantize_codes(torch.randn(2, 8, 4, 4))  # k-means init
    latents = torch.randn(2, 8, 4, 4)
    flat = torch.nn.functional.normalize(latents.permute(0, 2, 3, 1).reshape(-1, 8), dim=-1)
    cosine = (flat @ improved.quantize.codebook.T).argmax(-1)
    assert torch.equal(improved.quantize_codes(latents).flatten(), cosine)


def test_encode_accepts_pil_images_paths_bytes_and_tensors_alike(tmp_path):
    tokenizer = _tiny().eval()
    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 256, (40, 48, 3), dtype=np.uint8), "RGB")
    path = tmp_path / "x.png"
    image.save(path)
    expected = tokenizer.encode(preprocess(image, 32).unsqueeze(0))
    assert torch.equal(tokenizer.encode(image), expected)
    assert torch.equal(tokenizer.encode(path), expected)
    assert torch.equal(tokenizer.encode(str(path)), expected)
    assert torch.equal(tokenizer.encode(path.read_bytes()), expected)
    assert torch.equal(tokenizer.encode([image, path]), torch.cat([expected, expected]))
    assert torch.equal(tokenizer.encode(preprocess(image, 32)), expected)  # a single (3, H, W) tensor
    assert torch.equal(tokenizer.encode(torch.cat([preprocess(image, 32)[None]] * 5), batch_size=2)[4:], expected)
    assert isinstance(tokenizer.to_pil(tokenizer.decode(expected)[0]), Image.Image)


def test_bad_inputs_raise_clear_errors():
    tokenizer = _tiny().eval()
    with pytest.raises(ValueError, match=r"\[-1, 1\]"):
        tokenizer.encode(torch.rand(1, 3, 32, 32) * 255)
    with pytest.raises(ValueError, match="multiples of 4"):
        tokenizer.encode(torch.zeros(1, 3, 30, 30))
    with pytest.raises(ValueError, match=r"\[0, 32\)"):
        tokenizer.decode(torch.full((1, 4, 4), 32))
    with pytest.raises(ValueError, match=r"\[0, 32\)"):
        tokenizer.decode(torch.full((4, 4), -1))
    with pytest.raises(ValueError, match="integer"):
        tokenizer.decode(torch.zeros(1, 4, 4))
    with pytest.raises(ValueError, match="not an image"):
        tokenizer.encode(io.BytesIO(b"x").getvalue())


def test_save_and_load_round_trip_keeps_weights_codebook_codes_and_fingerprint(tmp_path):
    tokenizer = _tiny("improved").train()
    pixels = torch.rand(4, 3, 32, 32) * 2 - 1
    tokenizer(pixels)  # k-means init + one EMA update, so the codebook buffers are non-trivial
    tokenizer.eval()
    tokenizer.save_pretrained(tmp_path / "bundle")
    assert sorted(p.name for p in (tmp_path / "bundle").iterdir()) == ["config.json", "model.safetensors"]
    loaded = ImageTokenizer.from_pretrained(tmp_path / "bundle")
    assert loaded.config == tokenizer.config and not loaded.training
    for (name, a), (_, b) in zip(sorted(tokenizer.state_dict().items()), sorted(loaded.state_dict().items())):
        assert torch.equal(a, b), name
    assert torch.equal(loaded.encode(pixels), tokenizer.encode(pixels))
    assert loaded.fingerprint() == tokenizer.fingerprint()
    with torch.no_grad():
        loaded.decoder.conv_out.bias.add_(1e-3)
    assert loaded.fingerprint() != tokenizer.fingerprint()


def test_from_pretrained_names_the_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        ImageTokenizer.from_pretrained(tmp_path)
