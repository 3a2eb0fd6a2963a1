"""The project's one command line: a subcommand per pipeline step (see `python train.py --help`)."""

from __future__ import annotations

import importlib
import sys

# subcommand -> (module exposing `main(argv: list[str]) -> int | None`, one-line help).
# Modules are imported only when their subcommand runs, so `--help` stays instant.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "vocab": ("tokenizer.vocab_cli", "train the BPE text vocabulary and merge it with the image codes"),
    "tokenizer": ("tokenizer.image.cli", "train / validate / export the VQ image tokenizer (LightningCLI)"),
    "shards": ("data_shards.cli", "write raw webdataset shards and pre-tokenize them into token shards"),
    "fit": ("fusion_model.train_cli", "pretrain the fused decoder on token shards (LightningCLI)"),
    "generate": ("fusion_model.generate_cli", "sample mixed text-and-image sequences from a checkpoint"),
    "convert": ("fusion_model.convert_cli", "import from / export to transformers' Chameleon format"),
    "demo": ("fusion_model.demo.pipeline", "run the end-to-end demo on built-in offline data, with a report"),
}


def usage() -> str:
    """Return the top-level help text."""
    width = max(len(name) for name in SUBCOMMANDS)
    lines = [
        "usage: python train.py <command> [options]",
        "",
        "Early-fusion (Chameleon-style) multimodal training, one step per command:",
        "",
    ]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
    lines += ["", "Run `python train.py <command> --help` for the options of a command."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Dispatch to the subcommand's module."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in {"-h", "--help", "help"}:
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"train.py: unknown command {name!r}; choose one of: {', '.join(SUBCOMMANDS)}", file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[name][0])
    code = module.main(rest)
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())
