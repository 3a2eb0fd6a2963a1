"""The command line: one subcommand per pipeline step (`python train.py --help`), one exit-code rule."""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module exposing `main(argv: list[str]) -> int | None`, one-line help): this layer's commands.
# Modules are imported only when their subcommand runs, so `--help` stays instant. A higher layer adds its own
# commands by passing a larger table to `main` (experiments.commands adds `demo` and `experiment`), so that
# no module here names one above it.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "vocab": ("fusion_model.cli.vocab", "train the BPE text vocabulary and merge it with the image codes"),
    "tokenizer": ("fusion_model.cli.tokenizer", "train / validate / export the VQ image tokenizer (LightningCLI)"),
    "shards": ("fusion_model.cli.shards", "write raw webdataset shards and pre-tokenize them into token shards"),
    "fit": ("fusion_model.cli.fit", "pretrain or fine-tune the fused decoder on token shards (LightningCLI)"),
    "plan": ("fusion_model.cli.plan", "the memory a fit run needs per device, before anything is allocated"),
    "generate": ("fusion_model.cli.generate", "sample mixed text-and-image sequences from a checkpoint"),
    "convert": ("fusion_model.cli.convert", "import from / export to transformers' Chameleon format"),
}

# Bad input (a missing file, a wrong value, a mismatched vocabulary) exits 2 with one line naming what to change,
# as argparse does for a bad flag; a run that fails after it started (e.g. a NaN loss) exits 1.
BAD_INPUT_EXIT = 2
BAD_INPUT_ERRORS: tuple[type[BaseException], ...] = (
    ValueError, FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError,
)

# The LightningCLI commands keep their generated `--section.option` names and also take the shared flags;
# each maps a shared flag onto its own option (see `translate_shared_flags`).
# --media-tokenizer (an image or video tokenizer bundle) is also spelled --image-tokenizer, its older name
FIT_SHARED_FLAGS = {"--checkpoint": "--ckpt_path", "--vocab": "--data.vocab", "--media-tokenizer": "--data.image_tokenizer",
                    "--image-tokenizer": "--data.image_tokenizer"}
TOKENIZER_SHARED_FLAGS = {"--checkpoint": "--ckpt_path"}


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help with each option's default, except uninformative ones (None, a switch's False, a repeatable
    option's empty list): those help lines say what leaving the option out means."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False or action.default == []:
            return action.help
        return super()._get_help_string(action)


def usage(commands: dict[str, tuple[str, str]] | None = None) -> str:
    """Return the top-level help text listing `commands` (default: this layer's SUBCOMMANDS)."""
    commands = SUBCOMMANDS if commands is None else commands
    width = max(len(name) for name in commands)
    lines = [
        "usage: python train.py <command> [options]",
        "",
        "Early-fusion (Chameleon-style) multimodal training, one step per command:",
        "",
    ]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in commands.items()]
    lines += [
        "",
        "Run `python train.py <command> --help` for the options of a command. The same things have the same",
        "flags everywhere: --checkpoint, --vocab (tokenizer.json), --media-tokenizer (an image or video tokenizer",
        "bundle directory; also spelled --image-tokenizer), --out.",
        "Bad input exits with code 2 and one line saying what to change.",
    ]
    return "\n".join(lines)


def translate_shared_flags(argv: list[str], aliases: dict[str, str]) -> list[str]:
    """Rewrite shared flags (`--checkpoint X`, `--vocab=X`) into a LightningCLI command's own option names."""
    out: list[str] = []
    for index, arg in enumerate(argv):
        if arg == "--":  # everything after `--` is a value, never a flag
            return out + argv[index:]
        name, sep, value = arg.partition("=")
        out.append(aliases[name] + sep + value if name in aliases else arg)
    return out


def shared_flags_epilog(aliases: dict[str, str]) -> str:
    """The `--help` epilog of a LightningCLI command: which shared flag stands for which of its options."""
    pairs = "; ".join(f"{flag} X = {option} X" for flag, option in aliases.items())
    return f"Shared flags (the same in every train.py command): {pairs}."


def main(argv: list[str] | None = None, commands: dict[str, tuple[str, str]] | None = None) -> int:
    """Dispatch to the subcommand's module in `commands` (default: this layer's SUBCOMMANDS; the caller at the top
    of the stack passes the full table); bad input becomes one line on stderr and exit code 2."""
    commands = SUBCOMMANDS if commands is None else commands
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in {"-h", "--help", "help"}:
        print(usage(commands))
        return 0
    name, rest = argv[0], argv[1:]
    if name not in commands:
        print(f"train.py: unknown command {name!r}; choose one of: {', '.join(commands)}", file=sys.stderr)
        return BAD_INPUT_EXIT
    module = importlib.import_module(commands[name][0])
    try:
        code = module.main(rest)
    except BAD_INPUT_ERRORS as error:
        print(f"train.py {name}: {error}", file=sys.stderr)
        return BAD_INPUT_EXIT
    return int(code or 0)
