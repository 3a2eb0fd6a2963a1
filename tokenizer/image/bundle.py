"""One entry point for both kinds of image tokenizer: build one from a config, load a bundle of either kind
(`tokenizer.bundle.load_media_tokenizer` also loads video bundles)."""

from __future__ import annotations

import os

import torch

from tokenizer.image.config import ImageTokenizerConfig
from tokenizer.image.continuous import ContinuousImageTokenizer
from tokenizer.image.image_tokenizer import ImageTokenizer, read_bundle_config
from tokenizer.video.config import is_video_bundle

AnyImageTokenizer = ImageTokenizer | ContinuousImageTokenizer
BUNDLE_CLASSES: dict[str, type[ImageTokenizer] | type[ContinuousImageTokenizer]] = {
    "vq": ImageTokenizer,
    "kl": ContinuousImageTokenizer,
}


def build_image_tokenizer(config: ImageTokenizerConfig) -> AnyImageTokenizer:
    """A freshly initialised tokenizer of the class `config.bottleneck` names."""
    return BUNDLE_CLASSES[config.bottleneck](config)


def load_image_tokenizer(directory: str | os.PathLike, map_location: str | torch.device = "cpu") -> AnyImageTokenizer:
    """The image bundle in `directory`, VQ or continuous (check `.kind`: "vq", "continuous"), in eval mode."""
    if is_video_bundle(directory):
        raise ValueError(
            f"{directory} holds a video tokenizer bundle, not an image one: load it with "
            "tokenizer.bundle.load_media_tokenizer, which loads every kind"
        )
    config = read_bundle_config(directory)
    return BUNDLE_CLASSES[config.bottleneck].from_pretrained(directory, map_location=map_location)
