"""`python train.py fit --config configs/fusion/<preset>.yaml`: LightningCLI over the Lightning module and the data module."""

from __future__ import annotations

import os
import sys
import tempfile
import warnings
from pathlib import Path

import torch
from lightning.pytorch.cli import LightningCLI

from data_shards.datamodule import FusionDataModule
from fusion_model.cli import FIT_SHARED_FLAGS, shared_flags_epilog, translate_shared_flags
from fusion_model.training.checkpointing import broken_checkpoint_message
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

    def _parse_ckpt_path(self) -> None:
        """Lightning's read of the hparams in --ckpt_path, with a broken file turned into one line naming a good one."""
        subcommand = self.config.get("subcommand")
        ckpt_path = self.config[subcommand].get("ckpt_path") if subcommand else None
        try:
            super()._parse_ckpt_path()
        except Exception as err:  # noqa: BLE001 - torch/zip/unpickling errors alike: re-raised naming the file
            if not ckpt_path:
                raise
            raise ValueError(broken_checkpoint_message(Path(ckpt_path), err)) from err

    def before_fit(self) -> None:
        """Check that checkpoints can be written before training starts, not at the first save hours later."""
        directories = [self.trainer.default_root_dir]
        directories += [cb.dirpath for cb in self.trainer.checkpoint_callbacks if getattr(cb, "dirpath", None)]
        for directory in dict.fromkeys(str(d) for d in directories):
            problem = unwritable_reason(Path(directory))
            if problem is not None:
                raise ValueError(
                    f"checkpoint directory {directory} cannot be written ({problem}); choose a writable "
                    "--trainer.default_root_dir or ModelCheckpoint dirpath, or fix the directory's permissions"
                )

    def before_instantiate_classes(self) -> None:
        """Pick the precision from the hardware when the config leaves it unset."""
        config = self.config.get(self.subcommand, self.config) if self.subcommand else self.config
        if config.trainer.get("precision") is None:
            config.trainer.precision = "bf16-mixed" if torch.cuda.is_available() else "32-true"


def unwritable_reason(directory: Path) -> str | None:
    """Why files cannot be created in `directory` (or the folder it would be created in), or None if they can."""
    existing = directory
    while not existing.exists():  # a directory made later: its nearest existing parent must take it
        if existing.parent == existing:
            break
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is not a directory"
    try:  # a real write: os.access says yes to root on a read-only mount
        handle, probe = tempfile.mkstemp(prefix=".write-test-", dir=existing)
    except OSError as err:
        return f"{existing}: {err.strerror or err}"
    os.close(handle)
    os.unlink(probe)
    return None


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
