"""`python train.py tokenizer fit|validate|test|predict ...` (LightningCLI) and `... tokenizer export` (checkpoint ->
inference bundle of config json + safetensors)."""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import torch

EXPORT_HELP = "usage: python train.py tokenizer export --ckpt PATH --out DIR"


def export(argv: list[str]) -> int:
    """Convert a Lightning checkpoint of `ImageTokenizerModule` into an `ImageTokenizer.from_pretrained` bundle."""
    from tokenizer.image.lightning import ImageTokenizerModule

    parser = argparse.ArgumentParser(prog="train.py tokenizer export", description=export.__doc__)
    parser.add_argument(
        "--ckpt", required=True, help="Lightning checkpoint (.ckpt) written by `tokenizer fit`"
    )
    parser.add_argument("--out", required=True, help="directory for config.json + model.safetensors")
    args = parser.parse_args(argv)
    path = Path(args.ckpt)
    if not path.is_file():
        print(f"train.py tokenizer export: checkpoint {path} not found", file=sys.stderr)
        return 2
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # weights_only refuses arbitrary objects: say so instead of unpickling them
        print(
            f"train.py tokenizer export: {path} is not loadable with weights_only=True ({err}); "
            "it was not written by `tokenizer fit`, or holds objects we refuse to unpickle",
            file=sys.stderr,
        )
        return 2
    hparams = dict(checkpoint.get("hyper_parameters", {}))
    module = ImageTokenizerModule(**{k: v for k, v in hparams.items() if not k.startswith("_")})
    module.load_state_dict(checkpoint["state_dict"], strict=True)
    out = module.tokenizer.save_pretrained(args.out)
    print(f"image tokenizer bundle written to {out} (fingerprint {module.tokenizer.fingerprint()})")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point for `train.py tokenizer`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "export":
        return export(argv[1:])
    from lightning.pytorch.cli import LightningCLI

    from tokenizer.image.lightning import ExportTokenizer, ImageDataModule, ImageTokenizerModule

    if not argv or argv[0] in {"-h", "--help"}:
        print(
            "usage: python train.py tokenizer {fit,validate,test,predict,export} [--config configs/tokenizer/<preset>.yaml]"
            "\n\nLightningCLI subcommands train/validate the VQ image tokenizer; `export` turns a checkpoint into an"
            " inference bundle.\n" + EXPORT_HELP
        )
        if not argv:
            return 2
        return 0

    class TokenizerCLI(LightningCLI):
        """LightningCLI whose default logging is TensorBoard + CSV under trainer.default_root_dir."""

        def instantiate_trainer(self, **kwargs):
            trainer = self._get(self.config_init, "trainer", default={})
            if trainer.get("logger") in (None, True):
                from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

                root = trainer.get("default_root_dir") or "runs/tokenizer"
                kwargs["logger"] = [TensorBoardLogger(root, name="tb"), CSVLogger(root, name="csv")]
            return super().instantiate_trainer(**kwargs)

    # `args` is how train.py passes the subcommand's arguments; the check that warns about it assumes sys.argv
    warnings.filterwarnings("ignore", message="LightningCLI's args parameter")
    TokenizerCLI(
        ImageTokenizerModule,
        ImageDataModule,
        args=argv,
        trainer_defaults={"callbacks": [ExportTokenizer()], "default_root_dir": "runs/tokenizer"},
        save_config_kwargs={"overwrite": True},
        seed_everything_default=0,
    )
    return 0
