"""`python train.py convert import|export`: move decoder weights between our checkpoints and transformers' Chameleon."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from fusion_model.cli import DefaultsHelpFormatter

# The keys of fusion_model.hf_convert.DTYPES, named here so that `--help` needs no torch import (a test keeps
# the two equal).
DTYPE_NAMES = ("bfloat16", "float32")


def _load_hf(source: str):
    """(ChameleonForConditionalGeneration in float32, whether its VQ encoder weights were all in the folder)."""
    from fusion_model.hf_convert import load_transformers_folder

    if not (Path(source) / "config.json").is_file():
        raise FileNotFoundError(f"{source} has no config.json: give `convert import` a local transformers Chameleon directory")
    hf_model, info = load_transformers_folder(source, output_loading_info=True)
    return hf_model, not any("vqmodel" in key for key in info["missing_keys"])


def import_transformers(source: str, output: str) -> Path:
    """transformers Chameleon directory -> our checkpoint file."""
    from fusion_model.checkpoint import save_model
    from fusion_model.hf_convert import from_transformers

    hf_model, _ = _load_hf(source)
    return save_model(from_transformers(hf_model), output)


def import_folder(source: str, output: str) -> list[str]:
    """transformers Chameleon directory -> a folder with what `train.py fit` takes: model.ckpt, tokenizer.json
    (when the folder's tokenizer has our layout) and image_tokenizer/ (from the side folder of our export, or
    from a trained model.vqmodel); returns one line per file written or skipped."""
    from common.compat import check_compatible
    from common.files import replace_directory
    from fusion_model.checkpoint import save_model
    from fusion_model.hf_convert import IMAGE_TOKENIZER_FOLDER, from_transformers, released_layout
    from tokenizer.image import ImageTokenizer
    from tokenizer.vocab import UnifiedVocab

    source_dir, out = Path(source), Path(output)
    hf_model, vq_loaded = _load_hf(source)
    model = from_transformers(hf_model)
    out.mkdir(parents=True, exist_ok=True)
    lines = [f"convert: wrote {save_model(model, out / 'model.ckpt')}"]
    vocab = None
    released = released_layout(source_dir / "tokenizer.json") if (source_dir / "tokenizer.json").is_file() else None
    try:
        if released:
            raise ValueError(released)
        vocab = UnifiedVocab.load(source_dir / "tokenizer.json", expected_vocab_size=model.config.vocab_size)
    except (FileNotFoundError, ValueError) as error:
        lines.append(f"convert: no tokenizer.json written: {error}")
    image_tokenizer, origin = None, ""
    if (source_dir / IMAGE_TOKENIZER_FOLDER).is_dir():
        image_tokenizer, origin = ImageTokenizer.from_pretrained(source_dir / IMAGE_TOKENIZER_FOLDER), "its bundle"
    elif vq_loaded:
        image_tokenizer = ImageTokenizer.from_transformers(hf_model.model.vqmodel)
        origin = "model.vqmodel; its decoder is untrained: transformers has none"
    else:
        lines.append("convert: no image tokenizer written: the folder's model.vqmodel has no weights")
    check_compatible(model=model.config, vocab=vocab, image_tokenizer=image_tokenizer)
    if vocab is not None:
        lines.append(f"convert: wrote {vocab.save(out / 'tokenizer.json')}")
    if image_tokenizer is not None:
        with tempfile.TemporaryDirectory(dir=out, prefix=".image_tokenizer-") as scratch:
            replace_directory(image_tokenizer.save_pretrained(Path(scratch) / "bundle"), out / IMAGE_TOKENIZER_FOLDER)
        lines.append(f"convert: wrote {out / IMAGE_TOKENIZER_FOLDER} (from {origin})")
    return lines


def export_transformers(
    checkpoint: str, output: str, vocab: str | None = None, image_tokenizer: str | None = None,
    dtype: str | None = None,
) -> Path:
    """Our checkpoint -> transformers Chameleon directory: weights and config, and with --vocab the tokenizer,
    generation_config.json and (with an image tokenizer) the processor files."""
    from fusion_model.checkpoint import checkpoint_config
    from fusion_model.families.loading import load_family
    from fusion_model.hf_convert import DTYPES, check_exportable, to_transformers

    if not Path(checkpoint).is_dir():  # a transformers folder is dense; a file's config says, read without its weights
        check_exportable(checkpoint_config(checkpoint), f"{checkpoint}: ")
    loaded = load_family(checkpoint)
    if not loaded.family.exportable:
        raise ValueError(f"{checkpoint} is a {loaded.family.name} checkpoint, which transformers' Chameleon cannot "
                         "hold (only its decoder would be written, without what feeds it images): export a chameleon "
                         "checkpoint, or sample this one with `train.py generate`")
    model = loaded.parts["model"]
    tokenizer = None
    if image_tokenizer is not None:
        from tokenizer.image import ImageTokenizer

        tokenizer = ImageTokenizer.from_pretrained(image_tokenizer)
    return to_transformers(model, output, image_tokenizer=tokenizer, vocab=vocab,
                           dtype=DTYPES[dtype] if dtype else None)


def export_summary(directory: Path) -> list[str]:
    """What an export holds and how to load it, one line each."""
    from fusion_model.hf_convert import IMAGE_TOKENIZER_FOLDER

    lines = [f"convert: wrote {directory} (ChameleonForConditionalGeneration.from_pretrained loads it)"]
    if (directory / "processor_config.json").is_file():
        lines.append("convert: AutoProcessor.from_pretrained loads its tokenizer and image processor")
    elif (directory / "tokenizer.json").is_file():
        lines.append("convert: AutoTokenizer.from_pretrained loads its tokenizer (no image tokenizer: no processor)")
    if (directory / IMAGE_TOKENIZER_FOLDER).is_dir():
        lines.append(f"convert: the image tokenizer has no transformers layout: it is in {directory / IMAGE_TOKENIZER_FOLDER}"
                     " (tokenizer.image.ImageTokenizer.from_pretrained); model.vqmodel is a placeholder")
    return lines


def parser() -> argparse.ArgumentParser:
    """The command-line options."""
    p = argparse.ArgumentParser(prog="train.py convert", description=__doc__)
    sub = p.add_subparsers(dest="direction", required=True)
    imp = sub.add_parser("import", help="transformers Chameleon directory -> fusion checkpoint (.ckpt)",
                         description="transformers Chameleon directory -> fusion checkpoint (.ckpt)",
                         formatter_class=DefaultsHelpFormatter)
    imp.add_argument("source", metavar="HF_DIR", help="local directory with config.json + safetensors")
    imp.add_argument("--out", required=True, metavar="CKPT|DIR",
                     help="a .ckpt file to write the decoder to, or a folder for model.ckpt, tokenizer.json "
                          "(when the folder's tokenizer has this project's layout) and image_tokenizer/")
    exp = sub.add_parser("export", help="fusion checkpoint (.ckpt) -> transformers Chameleon directory",
                         description="fusion checkpoint (.ckpt) -> transformers Chameleon directory",
                         formatter_class=DefaultsHelpFormatter)
    exp.add_argument("--checkpoint", required=True, metavar="CKPT",
                     help="Lightning checkpoint written by `train.py fit` (or by `convert import`)")
    exp.add_argument("--out", required=True, metavar="DIR", help="directory to write")
    exp.add_argument("--vocab", help="the unified tokenizer.json: names the vocabulary and adds the tokenizer files, "
                                     "generation_config.json (the text-mode rule) and, with --image-tokenizer, the "
                                     "processor files")
    exp.add_argument("--media-tokenizer", "--image-tokenizer", dest="image_tokenizer", metavar="BUNDLE",
                     help="image tokenizer directory: a Chameleon-layout one becomes model.vqmodel, another "
                          "(the 'improved' quantizer) is copied to OUT/image_tokenizer/; sets the processor's "
                          "image size and image_seq_length")
    exp.add_argument("--dtype", choices=DTYPE_NAMES, help="dtype of the exported weights (default: the checkpoint's)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point for `python train.py convert ...`; bad input raises ValueError (exit code 2 in `train.py`)."""
    args = parser().parse_args(argv)
    if args.direction == "import":
        if Path(args.out).suffix == ".ckpt":
            path = import_transformers(args.source, args.out)
        else:
            print("\n".join(import_folder(args.source, args.out)))
            return 0
    else:
        try:
            path = export_transformers(args.checkpoint, args.out, args.vocab, args.image_tokenizer, args.dtype)
        except TypeError as error:  # to_transformers refuses an image tokenizer of another layout
            raise ValueError(str(error)) from error
        print("\n".join(export_summary(path)))
        return 0
    print(f"convert: wrote {path}")
    return 0
