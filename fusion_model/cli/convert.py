"""`python train.py convert import|export`: move decoder weights between our checkpoints and transformers' Chameleon."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from fusion_model.checkpoint import load_model, save_model
from fusion_model.hf_convert import from_transformers, to_transformers


def import_transformers(source: str, output: str) -> Path:
    """transformers Chameleon directory -> our checkpoint file."""
    from transformers import ChameleonForConditionalGeneration

    if not (Path(source) / "config.json").is_file():
        raise FileNotFoundError(f"{source} has no config.json: give `convert import` a local transformers Chameleon directory")
    hf_model = ChameleonForConditionalGeneration.from_pretrained(source, local_files_only=True, dtype=torch.float32)
    return save_model(from_transformers(hf_model), output)


def export_transformers(checkpoint: str, output: str, vocab: str | None = None, image_tokenizer: str | None = None) -> Path:
    """Our checkpoint -> transformers Chameleon directory (config.json + model.safetensors [+ tokenizer.json])."""
    model = load_model(checkpoint)
    tokenizer = None
    if image_tokenizer is not None:
        from tokenizer.image import ImageTokenizer

        tokenizer = ImageTokenizer.from_pretrained(image_tokenizer)
    return to_transformers(model, output, image_tokenizer=tokenizer, vocab=vocab)


def parser() -> argparse.ArgumentParser:
    """The command-line options."""
    p = argparse.ArgumentParser(prog="train.py convert", description=__doc__)
    sub = p.add_subparsers(dest="direction", required=True)
    imp = sub.add_parser("import", help="transformers Chameleon directory -> fusion checkpoint (.ckpt)",
                         description="transformers Chameleon directory -> fusion checkpoint (.ckpt)")
    imp.add_argument("source", metavar="HF_DIR", help="local directory with config.json + safetensors")
    imp.add_argument("--out", required=True, metavar="CKPT", help="checkpoint file to write")
    exp = sub.add_parser("export", help="fusion checkpoint (.ckpt) -> transformers Chameleon directory",
                         description="fusion checkpoint (.ckpt) -> transformers Chameleon directory")
    exp.add_argument("--checkpoint", required=True, metavar="CKPT",
                     help="Lightning checkpoint written by `train.py fit` (or by `convert import`)")
    exp.add_argument("--out", required=True, metavar="DIR", help="directory to write")
    exp.add_argument("--vocab", help="the unified tokenizer.json (names the vocabulary; copied into the output)")
    exp.add_argument("--image-tokenizer", help="image tokenizer directory (Chameleon layout) to export as vqmodel")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point for `python train.py convert ...`; bad input raises ValueError (exit code 2 in `train.py`)."""
    args = parser().parse_args(argv)
    if args.direction == "import":
        path = import_transformers(args.source, args.out)
    else:
        try:
            path = export_transformers(args.checkpoint, args.out, args.vocab, args.image_tokenizer)
        except TypeError as error:  # to_transformers refuses an image tokenizer of another layout
            raise ValueError(str(error)) from error
    print(f"convert: wrote {path}")
    return 0
