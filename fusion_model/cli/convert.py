"""`python train.py convert import|export`: move decoder weights between our checkpoints and transformers' Chameleon."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

from fusion_model.config import FusionConfig
from fusion_model.model import FusionModel


def load_checkpoint_model(path: str | os.PathLike) -> FusionModel:
    """A FusionModel from a Lightning checkpoint (`state_dict` with a `model.` prefix, config in hyper_parameters)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"convert: checkpoint {path} does not exist")
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    config = (checkpoint.get("hyper_parameters") or {}).get("config")
    if not isinstance(config, dict) or "state_dict" not in checkpoint:
        raise ValueError(
            f"convert: {path} is not a fusion checkpoint (expected 'state_dict' and hyper_parameters['config'])"
        )
    model = FusionModel(FusionConfig.from_dict(config))
    # a torch.compile'd model saves its weights under "_orig_mod."
    state = {k[len("model."):].replace("_orig_mod.", ""): v for k, v in checkpoint["state_dict"].items()
             if k.startswith("model.")}
    model.load_state_dict(state)
    return model


def save_checkpoint_model(model: FusionModel, path: str | os.PathLike) -> Path:
    """Write a weights-only checkpoint the trainer and sampler read (same layout as Lightning's), atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {
        "state_dict": {"model." + k: v.detach().cpu() for k, v in model.state_dict().items()},
        "hyper_parameters": {"config": model.config.to_dict()},
    }
    tmp = path.with_name(path.name + ".tmp")
    torch.save(body, tmp)
    os.replace(tmp, path)
    return path


def import_transformers(source: str, output: str) -> Path:
    """transformers Chameleon directory -> our checkpoint file."""
    from transformers import ChameleonForConditionalGeneration

    if not (Path(source) / "config.json").is_file():
        raise FileNotFoundError(f"convert import: {source} has no config.json (give a local transformers directory)")
    hf_model = ChameleonForConditionalGeneration.from_pretrained(source, local_files_only=True, dtype=torch.float32)
    return save_checkpoint_model(FusionModel.from_transformers(hf_model), output)


def export_transformers(checkpoint: str, output: str, vocab: str | None = None, image_tokenizer: str | None = None) -> Path:
    """Our checkpoint -> transformers Chameleon directory (config.json + model.safetensors [+ tokenizer.json])."""
    model = load_checkpoint_model(checkpoint)
    tokenizer = None
    if image_tokenizer is not None:
        from tokenizer.image import ImageTokenizer

        tokenizer = ImageTokenizer.from_pretrained(image_tokenizer)
    return model.to_transformers(output, image_tokenizer=tokenizer, vocab=vocab)


def parser() -> argparse.ArgumentParser:
    """The command-line options."""
    p = argparse.ArgumentParser(prog="train.py convert", description=__doc__)
    sub = p.add_subparsers(dest="direction", required=True)
    imp = sub.add_parser("import", help="transformers Chameleon directory -> fusion checkpoint (.ckpt)")
    imp.add_argument("source", help="local directory with config.json + safetensors")
    imp.add_argument("output", help="checkpoint file to write")
    exp = sub.add_parser("export", help="fusion checkpoint (.ckpt) -> transformers Chameleon directory")
    exp.add_argument("checkpoint", help="Lightning checkpoint written by `train.py fit` (or by `convert import`)")
    exp.add_argument("output", help="directory to write")
    exp.add_argument("--vocab", help="the unified tokenizer.json (names the vocabulary; copied into the output)")
    exp.add_argument("--image-tokenizer", help="image tokenizer directory (Chameleon layout) to export as vqmodel")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point for `python train.py convert ...`."""
    args = parser().parse_args(argv)
    try:
        if args.direction == "import":
            path = import_transformers(args.source, args.output)
        else:
            path = export_transformers(args.checkpoint, args.output, args.vocab, args.image_tokenizer)
    except (FileNotFoundError, ValueError, TypeError) as error:
        print(error if str(error).startswith("convert") else f"convert: {error}", file=sys.stderr)
        return 1
    print(f"convert: wrote {path}")
    return 0
