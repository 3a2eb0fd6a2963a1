"""`python train.py tokenizer fit|validate|test|predict ...` (LightningCLI) and `... tokenizer export` (checkpoint ->
inference bundle of config json + safetensors)."""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

from fusion_model.cli import TOKENIZER_SHARED_FLAGS, shared_flags_epilog, translate_shared_flags
from fusion_model.cli.lightning_options import (
    RUNTIME_OPTIONS_HELP,
    default_loggers,
    end_process_group,
    place_outputs_under_root,
    take_runtime_options,
    use_plain_progress_when_logging_to_a_file,
)

EXPORT_HELP = "usage: python train.py tokenizer export --checkpoint CKPT --out DIR"
LIGHTNING_SUBCOMMANDS = ("fit", "validate", "test", "predict")
DEFAULT_ROOT = "runs/tokenizer"


def export_parser() -> argparse.ArgumentParser:
    """The options of `tokenizer export`."""
    parser = argparse.ArgumentParser(prog="train.py tokenizer export", description=export.__doc__)
    parser.add_argument("--checkpoint", required=True, metavar="CKPT",
                        help="Lightning checkpoint (.ckpt) written by `tokenizer fit`")
    parser.add_argument("--out", required=True, metavar="DIR", help="directory to write config.json + model.safetensors to")
    return parser


def is_video_run(argv: list[str]) -> bool:
    """Whether the model preset of a `tokenizer fit|validate|...` command line (its last `--model.preset`, else the
    one of its last `--config` YAML that names one) is a video tokenizer preset (`video-...`, `emu3`)."""
    import yaml

    from tokenizer.video.config import VIDEO_PRESETS

    preset = None
    for i, arg in enumerate(argv):
        name, _, value = arg.partition("=")
        if name not in ("--model.preset", "--config"):
            continue
        value = value or (argv[i + 1] if i + 1 < len(argv) else "")
        if name == "--model.preset":
            preset = value
        elif Path(value).is_file():
            model = (yaml.safe_load(Path(value).read_text()) or {}).get("model") or {}
            named = model.get("preset", (model.get("init_args") or {}).get("preset"))
            preset = named if named is not None else preset
    return preset in VIDEO_PRESETS


def export(argv: list[str]) -> int:
    """Convert a Lightning checkpoint of `ImageTokenizerModule` into an `ImageTokenizer.from_pretrained` bundle."""
    args = export_parser().parse_args(argv)

    from common.files import load_checkpoint_file
    from tokenizer.image.lightning import ImageTokenizerModule, bundle_description
    from tokenizer.video.config import VIDEO_PRESETS
    from tokenizer.video.lightning import VideoTokenizerModule

    checkpoint = load_checkpoint_file(args.checkpoint)
    hparams = dict(checkpoint.get("hyper_parameters") or {})
    module_class = VideoTokenizerModule if hparams.get("preset") in VIDEO_PRESETS else ImageTokenizerModule
    try:
        module = module_class(**{k: v for k, v in hparams.items() if not k.startswith("_")})
        module.load_state_dict(checkpoint["state_dict"], strict=True)
    except (KeyError, TypeError, RuntimeError) as err:  # another kind of checkpoint: bad input, not a crash
        raise ValueError(
            f"{args.checkpoint} is not an image tokenizer checkpoint ({type(err).__name__}: {err}); "
            "pass a .ckpt written by `train.py tokenizer fit`"
        ) from err
    out = module.tokenizer.save_pretrained(args.out)
    print(f"{bundle_description(module.tokenizer)} written to {out} (fingerprint {module.tokenizer.fingerprint()})")
    return 0


def overview() -> str:
    """`train.py tokenizer --help`: the subcommands, the presets, the options most runs change (instant)."""
    presets = sorted(p.stem for p in (Path(__file__).resolve().parents[2] / "configs" / "tokenizer").glob("*.yaml"))
    return "\n".join([
        "usage: python train.py tokenizer {fit,validate,test,predict} --config configs/tokenizer/<preset>.yaml [options]",
        "       " + EXPORT_HELP.removeprefix("usage: "),
        "",
        "Train and evaluate an image tokenizer (LightningCLI), or turn a checkpoint into an inference bundle:",
        "VQ presets give integer codes (Chameleon), kl-* presets continuous latents (Transfusion), video-* presets",
        "train Emu3's video tokenizer on a folder of clips (4 frames -> 1 latent frame of codes; images too).",
        f"Presets (configs/tokenizer/): {', '.join(presets)}.",
        "",
        "Options most runs change (`tokenizer fit --help` lists all, with defaults; it takes a few seconds):",
        "  --data.source PATH         photos (built in), an image folder, or local webdataset shards (.tar)",
        "  --data.image_size N        training crop size in pixels (the preset's)",
        "  --data.batch_size N        images per step",
        "  --trainer.max_time DD:HH:MM:SS   stop after this long (with --trainer.max_steps auto: the time decides)",
        "  --trainer.default_root_dir DIR   logs (tb/, csv/), checkpoints and the bundle go here",
        "  --threads auto|N           CPU threads (auto: the cores other processes leave idle)",
        "  --checkpoint CKPT          resume from a checkpoint (= --ckpt_path)",
        "",
        "At the end of `fit` the inference bundle (config json + safetensors) is written to <default_root_dir>/tokenizer.",
        shared_flags_epilog(TOKENIZER_SHARED_FLAGS),
    ])


def main(argv: list[str] | None = None) -> int:
    """Entry point for `train.py tokenizer`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "export":
        return export(argv[1:])
    if not argv or argv[0] in {"-h", "--help"}:
        print(overview(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    if argv[0] not in LIGHTNING_SUBCOMMANDS:
        raise ValueError(f"unknown tokenizer command {argv[0]!r}; choose one of: {', '.join(LIGHTNING_SUBCOMMANDS)}, "
                         "export (python train.py tokenizer --help)")
    argv = [argv[0], *take_runtime_options(argv[1:], f"tokenizer {argv[0]}")]

    from lightning.pytorch.cli import LightningCLI

    from tokenizer.image.lightning import ExportTokenizer, ImageDataModule, ImageTokenizerModule
    from tokenizer.video.lightning import VideoDataModule, VideoTokenizerModule

    video = is_video_run(argv[1:])  # a video preset trains the video tokenizer on a folder of clips

    class TokenizerCLI(LightningCLI):
        """LightningCLI whose default logging is TensorBoard + CSV under trainer.default_root_dir."""

        def add_arguments_to_parser(self, parser) -> None:
            """Atomic checkpoint writes, and loads (`--checkpoint` / `--ckpt_path`) only with weights_only=True."""
            parser.set_defaults({
                "trainer.plugins": [{"class_path": "fusion_model.training.checkpointing.AtomicCheckpointIO"}],
            })

        def before_instantiate_classes(self) -> None:
            """A plain progress line instead of the bar when stdout is a file; checkpoints in <root>/checkpoints."""
            config = self.config.get(self.subcommand, self.config) if self.subcommand else self.config
            use_plain_progress_when_logging_to_a_file(config)
            place_outputs_under_root(config, DEFAULT_ROOT)

        def instantiate_trainer(self, **kwargs):
            loggers = default_loggers(self._get(self.config_init, "trainer", default={}), DEFAULT_ROOT)
            if loggers is not None:
                kwargs["logger"] = loggers
            trainer = super().instantiate_trainer(**kwargs)
            for callback in trainer.callbacks:  # one bundle path per run folder, not per logger version
                if isinstance(callback, ExportTokenizer) and callback.dirpath is None:
                    callback.dirpath = str(Path(trainer.default_root_dir) / "tokenizer")
            return trainer

    # `args` is how train.py passes the subcommand's arguments; the check that warns about it assumes sys.argv
    warnings.filterwarnings("ignore", message="LightningCLI's args parameter")
    # The module steps its optimizers itself and checkpoints after the step, so Lightning's advice (a 12-line code
    # sample printed into every log) about saving the state before optimization does not apply
    warnings.filterwarnings("ignore", message="Using ModelCheckpoint with manual optimization")
    try:
        TokenizerCLI(
            VideoTokenizerModule if video else ImageTokenizerModule,
            VideoDataModule if video else ImageDataModule,
            args=translate_shared_flags(argv, TOKENIZER_SHARED_FLAGS),
            trainer_defaults={"callbacks": [ExportTokenizer()], "default_root_dir": DEFAULT_ROOT},
            save_config_kwargs={"overwrite": True},
            seed_everything_default=0,
            parser_kwargs={name: {"epilog": shared_flags_epilog(TOKENIZER_SHARED_FLAGS) + " " + RUNTIME_OPTIONS_HELP}
                           for name in LIGHTNING_SUBCOMMANDS},
        )
    finally:
        end_process_group()
    return 0
