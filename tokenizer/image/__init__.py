"""The image tokenizers: the VQ one (Chameleon-layout VQGAN encoder/decoder, vector quantizer) and the continuous one
(the same encoder/decoder around a Gaussian), preprocessing, and the loader of either kind of bundle."""

from tokenizer.image.bundle import build_image_tokenizer, load_image_tokenizer
from tokenizer.image.config import PRESETS, ImageTokenizerConfig
from tokenizer.image.continuous import ContinuousImageTokenizer
from tokenizer.image.image_tokenizer import ImageTokenizer
from tokenizer.image.preprocess import ImageLoadError, LoadedBatch, load_batch, open_image, preprocess, to_pil

__all__ = [
    "PRESETS",
    "ContinuousImageTokenizer",
    "ImageLoadError",
    "ImageTokenizer",
    "ImageTokenizerConfig",
    "LoadedBatch",
    "build_image_tokenizer",
    "load_batch",
    "load_image_tokenizer",
    "open_image",
    "preprocess",
    "to_pil",
]
