"""Text and images in, text and PIL images out through the sampler (fusion_model.sampling.generate), and its written files."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

from fusion_model.sampling import SamplingConfig
from fusion_model.sampling.generate import generate
from fusion_model.sampling.output import write_samples
from tokenizer.image import ImageTokenizer, ImageTokenizerConfig
from tokenizer.vocab import train_unified_vocab

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sampling_helpers import CORPUS, steer, tiny_model  # noqa: E402


@pytest.fixture(scope="module")
def vocab():
    return train_unified_vocab(CORPUS, vocab_size=320, image_codes=16, num_specials=16)


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
