"""The whole command line: the cli layer's commands plus the demo's; `train.py` and `early-fusion` run `main`."""

from __future__ import annotations

from fusion_model import cli
from fusion_model.demo.experiments import EXPERIMENTS

# cli's table (vocab ... convert) followed by this layer's commands, in the order `--help` lists them.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    **cli.SUBCOMMANDS,
    "demo": ("fusion_model.demo.pipeline", "run the end-to-end demo on built-in offline data, with a report"),
    # the experiments' own registry names them: a new experiment is one module and one line there
    "experiment": ("fusion_model.demo.experiments",
                   "on the demo's data: " + ", ".join(f"{what} ({name})" for name, (_, what) in EXPERIMENTS.items())),
}


def main(argv: list[str] | None = None) -> int:
    """`python train.py <command> ...` with every command (see `fusion_model.cli.main`)."""
    return cli.main(argv, commands=SUBCOMMANDS)
