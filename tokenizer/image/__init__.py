"""The VQ image tokenizer: Chameleon-layout VQGAN encoder/decoder, vector quantizer, preprocessing."""

from tokenizer.image.config import PRESETS, ImageTokenizerConfig
from tokenizer.image.image_tokenizer import ImageTokenizer
from tokenizer.image.preprocess import ImageLoadError, LoadedBatch, load_batch, open_image, preprocess, to_pil

__all__ = [
    "PRESETS",
    "ImageLoadError",
    "ImageTokenizer",
    "ImageTokenizerConfig",
    "LoadedBatch",
    "load_batch",
    "open_image",
    "preprocess",
    "to_pil",
]
