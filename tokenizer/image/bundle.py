"""One entry point for both kinds of image tokenizer: build one from a config, load a bundle of either kind (or a
video tokenizer's bundle, which also encodes images)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from tokenizer.image.config import ImageTokenizerConfig
from tokenizer.image.continuous import ContinuousImageTokenizer
from tokenizer.image.image_tokenizer import ImageTokenizer, read_bundle_config

AnyImageTokenizer = ImageTokenizer | ContinuousImageTokenizer
BUNDLE_CLASSES: dict[str, type[ImageTokenizer] | type[ContinuousImageTokenizer]] = {
    "vq": ImageTokenizer,
    "kl": ContinuousImageTokenizer,
}


def build_image_tokenizer(config: ImageTokenizerConfig) -> AnyImageTokenizer:
    """A freshly initialised tokenizer of the class `config.bottleneck` names."""
    return BUNDLE_CLASSES[config.bottleneck](config)


def load_image_tokenizer(directory: str | os.PathLike, map_location: str | torch.device = "cpu") -> AnyImageTokenizer:
    """The bundle in `directory`, VQ, continuous or video (check `.kind`: "vq", "continuous", "video"), in eval mode."""
    config_path = Path(directory) / "config.json"
    if config_path.is_file():
        from tokenizer.video.config import is_video_config

        if is_video_config(json.loads(config_path.read_text())):
            from tokenizer.video.video_tokenizer import VideoTokenizer

            return VideoTokenizer.from_pretrained(directory, map_location=map_location)
    config = read_bundle_config(directory)
    return BUNDLE_CLASSES[config.bottleneck].from_pretrained(directory, map_location=map_location)
