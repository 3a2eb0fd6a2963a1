"""Fixtures the decoder's tests share: a tiny vocabulary and image tokenizer on disk."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tokenizer.image import ImageTokenizer, ImageTokenizerConfig
from tokenizer.vocab import train_unified_vocab

CORPUS = ["the cat sat on the mat", "a dog ran far away", "one two three four five six seven"] * 10
# the image tokenizer of `tiny_tokenizers`: 8 px images, 2x2 codes of a 16-entry codebook
TINY_VQ = ImageTokenizerConfig(image_size=8, base_channels=8, channel_multiplier=(1, 1, 1), num_res_blocks=1,
                               latent_channels=8, norm_groups=4, codebook_size=16)


@pytest.fixture(scope="module")
def tiny_tokenizers(tmp_path_factory) -> Path:
    """A folder with `tokenizer.json` (320 ids, 16 image codes), an image tokenizer `vq/` (2x2 codes of 16, 8 px),
    and `photo.png` (10 x 10 random pixels)."""
    root = tmp_path_factory.mktemp("tokenizers")
    vocab = train_unified_vocab(CORPUS, vocab_size=320, image_codes=16, num_specials=16)
    vocab.save(root / "tokenizer.json")
    torch.manual_seed(0)
    ImageTokenizer(TINY_VQ).save_pretrained(root / "vq")
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (10, 10, 3), dtype=np.uint8)).save(root / "photo.png")
    return root


@pytest.fixture(scope="session")
def tiny_vq_config() -> ImageTokenizerConfig:
    """The image tokenizer config of `tiny_tokenizers` (to build another with other weights)."""
    return TINY_VQ
