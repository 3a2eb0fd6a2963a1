"""`python train.py plan [fit's options]`: the memory a `fit` run needs per device, before anything is allocated.

Takes fit's config and options (`--config`, `--trainer.*`, `--model.*`, `--data.*`) and parses them with fit's own
parser, but builds no model: parameters are counted on a meta-device copy. Also `--device-memory GiB` (default: the
GPU's memory, on CPU the host's RAM), and `--model.peft '{rank: 16, targets: all}'` / `--model.train_only
image_head_rows` whether or not fit's parser has them yet. Exit 0 when the plan fits, 2 when it does not (the
sentence says what to change).
"""

from __future__ import annotations

import sys
import warnings

import yaml

from fusion_model.cli import FIT_SHARED_FLAGS, translate_shared_flags
from fusion_model.cli.fit import FusionCLI
from fusion_model.cli.lightning_options import take_option
from fusion_model.cli.memory_check import plan_of

HELP = __doc__


class PlanCLI(FusionCLI):
    """fit's parser and derivations, without instantiating anything: the config is planned and printed."""

    def before_instantiate_classes(self) -> None:
        """Derive the config as fit does (the horizon is not needed: a missing one is set to 1 step), then plan."""
        config = self.config
        if not (config.trainer.get("max_steps") or 0) > 0 and not config.trainer.get("max_time") \
                and not config.model.get("decay_steps"):
            config.trainer.max_steps = 1
        self.planning = True
        super().before_instantiate_classes()
        for key, value in self.what_if.items():
            if value is not None:
                config.model[key] = value
        self.plan, self.source = plan_of(config, self.device_memory)

    def instantiate_classes(self) -> None:
        """Nothing is built: the plan needs no weights."""


def main(argv: list[str] | None = None) -> int:
    """Entry point of `train.py plan`: print the plan; exit 2 (ValueError) when it does not fit the device."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(HELP)
    memory, argv = take_option(argv, "--device-memory", None)
    peft, argv = take_option(argv, "--model.peft", None)
    train_only, argv = take_option(argv, "--model.train_only", None)
    PlanCLI.device_memory = float(memory) if memory is not None else None
    PlanCLI.what_if = {"peft": yaml.safe_load(peft) if peft else None, "train_only": train_only}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*LightningCLI's args parameter.*")
        from data_shards.datamodule import FusionDataModule
        from fusion_model.training.lightning_module import FusionLightningModule

        cli = PlanCLI(FusionLightningModule, FusionDataModule, args=translate_shared_flags(argv, FIT_SHARED_FLAGS),
                      run=False, seed_everything_default=0)
    print(cli.plan.table())
    print(f"device memory from {cli.source}")
    if not cli.plan.fits:
        raise ValueError(cli.plan.advice)
    return 0
