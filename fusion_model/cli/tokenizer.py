"""`python train.py tokenizer fit|validate|test|predict ...` (LightningCLI) and `... tokenizer export` (checkpoint ->
inference bundle of config json + safetensors)."""

from __future__ import annotations

import argparse
import sys
import warnings

from fusion_model.cli import TOKENIZER_SHARED_FLAGS, shared_flags_epilog, translate_shared_flags

EXPORT_HELP = "usage: python train.py tokenizer export --checkpoint CKPT --out DIR"
LIGHTNING_SUBCOMMANDS = ("fit", "validate", "test", "predict")


def export_parser() -> argparse.ArgumentParser:
    """The options of `tokenizer export`."""
    parser = argparse.ArgumentParser(prog="train.py tokenizer export", description=export.__doc__)
    parser.add_argument("--checkpoint", required=True, metavar="CKPT",
                        help="Lightning checkpoint (.ckpt) written by `tokenizer fit`")
    parser.add_argument("--out", required=True, metavar="DIR", help="directory to write config.json + model.safetensors to")
    return parser


def export(argv: list[str]) -> int:
    """Convert a Lightning checkpoint of `ImageTokenizerModule` into an `ImageTokenizer.from_pretrained` bundle."""
    args = export_parser().parse_args(argv)

    from tokenizer.files import load_checkpoint_file
    from tokenizer.image.lightning import ImageTokenizerModule

    checkpoint = load_checkpoint_file(args.checkpoint)
    hparams = dict(checkpoint.get("hyper_parameters") or {})
    try:
        module = ImageTokenizerModule(**{k: v for k, v in hparams.items() if not k.startswith("_")})
        module.load_state_dict(checkpoint["state_dict"], strict=True)
    except (KeyError, TypeError, RuntimeError) as err:  # another kind of checkpoint: bad input, not a crash
        raise ValueError(
            f"{args.checkpoint} is not an image tokenizer checkpoint ({type(err).__name__}: {err}); "
            "pass a .ckpt written by `train.py tokenizer fit`"
        ) from err
    out = module.tokenizer.save_pretrained(args.out)
    print(f"image tokenizer bundle written to {out} (fingerprint {module.tokenizer.fingerprint()})")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point for `train.py tokenizer`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "export":
        return export(argv[1:])
    if not argv or argv[0] in {"-h", "--help"}:
        print(
            "usage: python train.py tokenizer {fit,validate,test,predict,export} [--config configs/tokenizer/<preset>.yaml]"
            "\n\nLightningCLI subcommands train/validate the VQ image tokenizer; `export` turns a checkpoint into an"
            " inference bundle.\n" + EXPORT_HELP + "\n\n" + shared_flags_epilog(TOKENIZER_SHARED_FLAGS),
            file=sys.stdout if argv else sys.stderr,
        )
        return 0 if argv else 2

    from lightning.pytorch.cli import LightningCLI

    from tokenizer.image.lightning import ExportTokenizer, ImageDataModule, ImageTokenizerModule

    class TokenizerCLI(LightningCLI):
        """LightningCLI whose default logging is TensorBoard + CSV under trainer.default_root_dir."""

        def add_arguments_to_parser(self, parser) -> None:
            """Atomic checkpoint writes, and loads (`--checkpoint` / `--ckpt_path`) only with weights_only=True."""
            parser.set_defaults({
                "trainer.plugins": [{"class_path": "fusion_model.training.checkpointing.AtomicCheckpointIO"}],
            })

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
        args=translate_shared_flags(argv, TOKENIZER_SHARED_FLAGS),
        trainer_defaults={"callbacks": [ExportTokenizer()], "default_root_dir": "runs/tokenizer"},
        save_config_kwargs={"overwrite": True},
        seed_everything_default=0,
        parser_kwargs={name: {"epilog": shared_flags_epilog(TOKENIZER_SHARED_FLAGS)} for name in LIGHTNING_SUBCOMMANDS},
    )
    return 0
