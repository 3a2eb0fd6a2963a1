"""Held-out evaluation of a trained tokenizer bundle: PSNR of reconstructions, and codebook usage and perplexity (VQ)
or latent statistics (continuous). `python -m tokenizer.image.evaluate BUNDLE_DIR [--samples N]` prints JSON (built-in
held-out photo crops)."""

from __future__ import annotations

import argparse
import json

import torch

from tokenizer.image.bundle import AnyImageTokenizer, load_image_tokenizer
from tokenizer.image.losses import psnr
from tokenizer.image.quantizer import codebook_stats


@torch.no_grad()
def evaluate(tokenizer: AnyImageTokenizer, pixels: torch.Tensor, batch_size: int = 32) -> dict[str, float]:
    """Mean PSNR (dB) of decode(encode(x)) over `pixels` (N, 3, H, W), with usage / perplexity of the codes (VQ) or
    the mean and std of the (scaled) latents (continuous)."""
    tokenizer.eval()
    encoded = tokenizer.encode(pixels, batch_size=batch_size)
    recon = tokenizer.decode(encoded, batch_size=batch_size)
    if tokenizer.kind == "continuous":
        stats = {"latent_mean": float(encoded.mean()), "latent_std": float(encoded.std()),
                 "latent_scale": float(tokenizer.latent_scale)}
    else:
        stats = codebook_stats(encoded, tokenizer.config.codebook_size)
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
    tokenizer = load_image_tokenizer(args.bundle)
    pixels = held_out_photo_crops(tokenizer.config.image_size, args.samples)
    print(json.dumps(evaluate(tokenizer, pixels), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
