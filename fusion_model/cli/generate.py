"""`python train.py generate`: sample mixed text-and-image sequences from a checkpoint and write them as
PNG files, a JSON of ids and a self-contained HTML page."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from fusion_model.checkpoint import load_model
from fusion_model.sample_output import write_samples
from fusion_model.sampling import MODES, SamplingConfig, generate


class _Segment(argparse.Action):
    """--prompt and --image append, in command-line order, to one list of prompt segments."""

    def __call__(self, parser, namespace, values, option_string=None):
        segments = list(getattr(namespace, "segments", None) or [])
        segments.append(values if self.dest == "prompt" else Path(values))
        namespace.segments = segments


def parser() -> argparse.ArgumentParser:
    """The command-line options (every one has a help line)."""
    p = argparse.ArgumentParser(
        prog="train.py generate",
        description=__doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog="Example: python train.py generate --checkpoint runs/fit/last.ckpt --vocab runs/vocab/tokenizer.json "
        "--image-tokenizer runs/tokenizer/export --prompt 'a photo of a seven' --mode image --cfg-scale 1.5",
    )
    io = p.add_argument_group("model and tokenizers")
    io.add_argument("--checkpoint", required=True,
                    help="a Lightning checkpoint (.ckpt from `train.py fit` or `train.py convert import`) "
                         "or a transformers Chameleon directory (from `train.py convert export`)")
    io.add_argument("--vocab", help="the unified tokenizer.json the model was trained with "
                                    "(default: tokenizer.json inside a transformers checkpoint directory)")
    io.add_argument("--image-tokenizer", help="image tokenizer directory (save_pretrained / `train.py tokenizer "
                                              "export`); needed for image prompts and image output")
    io.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="torch device")
    io.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                    help="decoder weight dtype (use float32 on CPU)")

    pr = p.add_argument_group("prompts")
    pr.add_argument("--prompt", action=_Segment, metavar="TEXT",
                    help="a text segment of the prompt; repeat and mix with --image, order is kept")
    pr.add_argument("--image", action=_Segment, metavar="PATH",
                    help="an image segment of the prompt (PNG/JPEG path); repeat and mix with --prompt")
    pr.add_argument("--prompts-file", metavar="JSONL",
                    help='one prompt per line: {"segments": [{"text": "..."}, {"image": "path"}]} or {"text": "..."}; '
                         "image paths are relative to the file")
    pr.add_argument("--num-samples", type=int, default=1, help="samples per prompt")
    pr.add_argument("--batch-size", type=int, default=8, help="prompts sampled together in one batch")

    s = p.add_argument_group("sampling")
    s.add_argument("--mode", choices=MODES, default="interleaved",
                   help="text: text only; image: one image right after the prompt; interleaved: the model chooses")
    s.add_argument("--max-new-tokens", type=int, default=None,
                   help="new tokens per sample (default: until </s> or the context is full; image mode: one image)")
    s.add_argument("--chameleon-defaults", action="store_true",
                   help="start from Chameleon's release settings (temperature 0.7, top-p 0.9, text repetition "
                        "penalty 1.2, three-stream CFG 1.2 / 3.0); explicit options below override them")
    for modality in ("text", "image"):
        s.add_argument(f"--{modality}-temperature", type=float, default=None,
                       help=f"temperature for {modality} tokens; 0 = greedy (default 1.0)")
        s.add_argument(f"--{modality}-top-k", type=int, default=None, help=f"top-k for {modality} tokens; 0 = off")
        s.add_argument(f"--{modality}-top-p", type=float, default=None, help=f"top-p for {modality} tokens; 1 = off")
    s.add_argument("--repetition-penalty", type=float, default=None, help="penalty on repeated text tokens; 1 = off")
    s.add_argument("--cfg-scale", type=float, default=None,
                   help="two-stream guidance for image tokens, u + s(c - u), u = the prompt '<s>'; 1 = off")
    s.add_argument("--cfg-image-scale", type=float, default=None,
                   help="three-stream guidance (with --cfg-text-scale): u + s_img(img - u) + s_txt(full - img), "
                        "img = only the prompt's images")
    s.add_argument("--cfg-text-scale", type=float, default=None, help="text scale of three-stream guidance")
    s.add_argument("--seed", type=int, default=0, help="random seed (batch k uses seed + k)")
    s.add_argument("--no-eos-stop", action="store_true", help="keep sampling after </s>")
    s.add_argument("--no-kv-cache", action="store_true", help="recompute the whole sequence each step (slow; for checks)")

    p.add_argument("--out", default="runs/samples", help="output directory (PNGs, samples.json, index.html)")
    return p


def read_prompts(args: argparse.Namespace) -> list[list[Any]]:
    """Prompts from --prompt/--image and --prompts-file, each a list of str / Path segments."""
    prompts: list[list[Any]] = []
    if getattr(args, "segments", None):
        prompts.append(list(args.segments))
    if args.prompts_file:
        path = Path(args.prompts_file)
        if not path.is_file():
            raise FileNotFoundError(f"--prompts-file {path} does not exist")
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            if not line.strip():
                continue
            try:
                entry = json.loads(line)
                items = entry["segments"] if "segments" in entry else [{"text": entry["text"]}]
                prompt = [s["text"] if "text" in s else path.parent / s["image"] for s in items]
            except (json.JSONDecodeError, KeyError, TypeError) as error:
                raise ValueError(
                    f'{path}:{number}: not a prompt ({error}); write {{"segments": [{{"text": "..."}}, {{"image": "a.png"}}]}}'
                ) from error
            prompts.append(prompt)
    if not prompts:
        prompts.append([])  # no prompt: sample from <s> alone
    return prompts


def sampling_config(args: argparse.Namespace) -> SamplingConfig:
    """SamplingConfig from the options (defaults, or Chameleon's with --chameleon-defaults)."""
    base = SamplingConfig.chameleon() if args.chameleon_defaults else SamplingConfig()
    values = dict(base.__dict__, mode=args.mode, max_new_tokens=args.max_new_tokens, seed=args.seed,
                  stop_at_eos=not args.no_eos_stop, use_kv_cache=not args.no_kv_cache)
    for name in ("text_temperature", "text_top_k", "text_top_p", "image_temperature", "image_top_k", "image_top_p",
                 "repetition_penalty", "cfg_scale", "cfg_image_scale", "cfg_text_scale"):
        if getattr(args, name) is not None:
            values[name] = getattr(args, name)
    if args.cfg_scale is not None and args.cfg_image_scale is None:
        values["cfg_image_scale"] = values["cfg_text_scale"] = None  # an explicit two-stream request wins
    return SamplingConfig(**values)


def run(args: argparse.Namespace) -> dict[str, Path]:
    """Load, sample in batches, write; returns the written JSON and HTML paths."""
    from tokenizer.vocab import UnifiedVocab

    if args.num_samples < 1 or args.batch_size < 1:
        raise ValueError("--num-samples and --batch-size must be at least 1")
    config = sampling_config(args)
    prompts = [p for p in read_prompts(args) for _ in range(args.num_samples)]
    dtype = getattr(torch, args.dtype)
    model = load_model(args.checkpoint).to(device=args.device, dtype=dtype).eval()
    bundled_vocab = Path(args.checkpoint) / "tokenizer.json"  # a transformers directory carries its vocabulary
    vocab_path = args.vocab or (bundled_vocab if bundled_vocab.is_file() else None)
    if vocab_path is None:
        raise ValueError("--vocab is required: pass the tokenizer.json the checkpoint was trained with")
    vocab = UnifiedVocab.load(vocab_path)
    image_tokenizer = None
    if args.image_tokenizer:
        from tokenizer.image import ImageTokenizer

        image_tokenizer = ImageTokenizer.from_pretrained(args.image_tokenizer, map_location=args.device)
    samples, ids = [], []
    for k, start in enumerate(range(0, len(prompts), args.batch_size)):
        batch_config = replace(config, seed=config.seed + k)
        out, new_ids = generate(model, vocab, image_tokenizer, prompts[start : start + args.batch_size], batch_config,
                                return_ids=True)
        samples += out
        ids += new_ids
    settings = asdict(config) | {"checkpoint": str(args.checkpoint)}
    return write_samples(args.out, samples, prompts=prompts, ids=ids, settings=settings, title="train.py generate")


def main(argv: list[str] | None = None) -> int:
    """Entry point for `python train.py generate ...`."""
    args = parser().parse_args(argv)
    try:
        paths = run(args)
    except (FileNotFoundError, ValueError, TypeError) as error:
        print(f"generate: {error}", file=sys.stderr)
        return 1
    print(f"generate: wrote {paths['html']} and {paths['json']}")
    return 0
