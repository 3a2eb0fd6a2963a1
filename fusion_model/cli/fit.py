"""`python train.py fit --config configs/fusion/<preset>.yaml`: LightningCLI over the Lightning module and the data module."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch
from lightning.pytorch.cli import LightningCLI

from data_shards.datamodule import FusionDataModule
from fusion_model.cli import FIT_SHARED_FLAGS, shared_flags_epilog, translate_shared_flags
from fusion_model.training.lightning_module import FusionLightningModule, NonFiniteLossError


class FusionCLI(LightningCLI):
    """LightningCLI with the project's defaults: fp32 on CPU, bf16-mixed on GPU, atomic checkpoints."""

    def add_arguments_to_parser(self, parser) -> None:
        """Every option stays settable from the command line; the YAML presets fill them in."""
        parser.set_defaults({
            "trainer.plugins": [{"class_path": "fusion_model.training.checkpointing.AtomicCheckpointIO"}],
            # the stream splits the data by rank itself; a re-built DataLoader would lose its resumable state
            "trainer.use_distributed_sampler": False,
        })

    def before_instantiate_classes(self) -> None:
        """Pick the precision from the hardware when the config leaves it unset."""
        config = self.config.get(self.subcommand, self.config) if self.subcommand else self.config
        if config.trainer.get("precision") is None:
            config.trainer.precision = "bf16-mixed" if torch.cuda.is_available() else "32-true"


def fit_from_config(config: str | Path | None = None, overrides: list[str] | None = None, run: bool = True) -> FusionCLI:
    """Train (or, with run=False, only build) from a YAML config plus command-line style overrides.

    Returns the CLI object: `.model` (FusionLightningModule), `.datamodule`, `.trainer`. The demo uses this.
    """
    args = ([f"--config={config}"] if config is not None else []) + list(overrides or [])
    if run:
        args = ["fit", *args]
    with warnings.catch_warnings():
        # train.py passes its own argv on explicitly; LightningCLI warns when sys.argv has arguments too
        warnings.filterwarnings("ignore", message=".*LightningCLI's args parameter.*")
        return FusionCLI(
            FusionLightningModule,
            FusionDataModule,
            args=args,
            run=run,
            save_config_kwargs={"overwrite": True},
            seed_everything_default=0,
            parser_kwargs={"fit": {"epilog": shared_flags_epilog(FIT_SHARED_FLAGS)}},
        )


def main(argv: list[str] | None = None) -> int:
    """Entry point of `train.py fit`; bad input raises ValueError, which `train.py` turns into exit code 2."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        fit_from_config(None, translate_shared_flags(argv, FIT_SHARED_FLAGS))
    except NonFiniteLossError as err:  # the run failed after it started: exit 1 (bad input exits 2 in train.py)
        print(f"train.py fit: {err}", file=sys.stderr)
        return 1
    return 0
