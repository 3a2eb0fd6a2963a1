"""The VQ image tokenizer: Chameleon-layout VQGAN encoder/decoder, vector quantizer, preprocessing."""

from tokenizer.image.preprocess import ImageLoadError, LoadedBatch, load_batch, open_image, preprocess, to_pil

__all__ = ["ImageLoadError", "LoadedBatch", "load_batch", "open_image", "preprocess", "to_pil"]
