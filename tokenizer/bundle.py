"""Load any media tokenizer bundle from its directory: a VQ or continuous image tokenizer, or a video tokenizer."""

from __future__ import annotations

import os

import torch

from tokenizer.image.bundle import AnyImageTokenizer, load_image_tokenizer
from tokenizer.video.config import is_video_bundle
from tokenizer.video.video_tokenizer import VideoTokenizer

AnyMediaTokenizer = AnyImageTokenizer | VideoTokenizer


def load_media_tokenizer(directory: str | os.PathLike, map_location: str | torch.device = "cpu") -> AnyMediaTokenizer:
    """The bundle in `directory`, VQ, continuous or video (check `.kind`: "vq", "continuous", "video"), in eval mode;
    a video tokenizer also encodes still images (as one-frame clips)."""
    if is_video_bundle(directory):
        return VideoTokenizer.from_pretrained(directory, map_location=map_location)
    return load_image_tokenizer(directory, map_location=map_location)
