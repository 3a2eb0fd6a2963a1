"""Held-out evaluation of a trained tokenizer bundle: PSNR of reconstructions, codebook usage, perplexity.
`python -m tokenizer.image.evaluate BUNDLE_DIR [--samples N]` prints JSON (built-in held-out photo crops)."""

from __future__ import annotations

import argparse
import json

import torch

from tokenizer.image.image_tokenizer import ImageTokenizer
from tokenizer.image.losses import psnr
from tokenizer.image.quantizer import codebook_stats


@torch.no_grad()
def evaluate(tokenizer: ImageTokenizer, pixels: torch.Tensor, batch_size: int = 32) -> dict[str, float]:
    """Mean PSNR (dB) of decode(encode(x)) and usage / perplexity of the codes over `pixels` (N, 3, H, W)."""
    tokenizer.eval()
    codes = tokenizer.encode(pixels, batch_size=batch_size)
    recon = tokenizer.decode(codes, batch_size=batch_size)
    stats = codebook_stats(codes, tokenizer.config.codebook_size)
    return {"psnr_db": float(psnr(recon, pixels.to(recon)).mean()), **stats, "images": int(pixels.shape[0])}


def held_out_photo_crops(size: int, samples: int, seed: int = 10_000) -> torch.Tensor:
    """The data module's validation set: crops of photos never used for training."""
    from tokenizer.image.data import HELD_OUT_PHOTOS, PhotoCrops

    dataset = PhotoCrops(HELD_OUT_PHOTOS, size, samples, seed=seed)
    return torch.stack([dataset[i] for i in range(samples)])


def main(argv: list[str] | None = None) -> int:
    """Print the held-out metrics of a bundle as JSON."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("bundle", help="directory written by save_pretrained / `train.py tokenizer export`")
    parser.add_argument("--samples", type=int, default=512)
    args = parser.parse_args(argv)
    tokenizer = ImageTokenizer.from_pretrained(args.bundle)
    pixels = held_out_photo_crops(tokenizer.config.image_size, args.samples)
    print(json.dumps(evaluate(tokenizer, pixels), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
