"""The checkout's whole command line: the library's pipeline commands (fusion_model.cli) plus `demo` and `experiment`;
`train.py` runs `main` (the installed `early-fusion` script runs the pipeline commands alone)."""

from __future__ import annotations

from experiments.run import EXPERIMENTS
from fusion_model import cli

# cli's table (vocab ... convert) followed by this layer's commands, in the order `--help` lists them.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    **cli.SUBCOMMANDS,
    "eval": ("evaluation.cli", "score a checkpoint of any family on a named suite (scenes, digits): results.json "
                               "and a sample page"),
    "demo": ("experiments.demo.pipeline", "run the end-to-end demo on built-in offline data, with a report"),
    # the experiments' own registry names them: a new experiment is one module and one line there
    "experiment": ("experiments.run",
                   "the experiments: " + ", ".join(f"{what} ({name})" for name, (_, what) in EXPERIMENTS.items())),
}


def main(argv: list[str] | None = None) -> int:
    """`python train.py <command> ...` with every command (see `fusion_model.cli.main`)."""
    return cli.main(argv, commands=SUBCOMMANDS)
