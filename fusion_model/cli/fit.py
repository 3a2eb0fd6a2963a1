"""`python train.py fit --config configs/fusion/<preset>.yaml`: LightningCLI over the Lightning module and the data module.

Besides LightningCLI's options: `--threads auto|N` (CPU threads; auto = the cores other processes leave idle)
and `--trainer.max_steps auto` (as many steps as fit in --trainer.max_time, the lr schedule fitted to them).
"""

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
from fusion_model.cli.lightning_options import (
    RUNTIME_OPTIONS_HELP,
    class_path_of,
    default_loggers,
    end_process_group,
    entry,
    last_checkpoint,
    missing_folders,
    place_outputs_under_root,
    remove_new_folders,
    take_runtime_options,
    time_limit_seconds,
    use_plain_progress_when_logging_to_a_file,
)
from fusion_model.cli.memory_check import PLAN_HELP, add_plan_arguments, check_before_fit, take_device_memory
from fusion_model.families import BUILTIN_FAMILIES
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
            "trainer.default_root_dir": DEFAULT_ROOT,
        })
        add_plan_arguments(parser)  # --plan.device_memory, --plan.force: the memory check before the model is built

    def _parse_ckpt_path(self) -> None:
        """Lightning's read of the hparams in --ckpt_path, with a broken file turned into one line naming a good one,
        and architecture options that the checkpoint's own would silently override refused."""
        subcommand = self.config.get("subcommand")
        ckpt_path = self.config[subcommand].get("ckpt_path") if subcommand else None
        if ckpt_path == "last":  # read like a path: its hyperparameters, not the command line's, build the model
            found = last_checkpoint(self.config[subcommand], DEFAULT_ROOT)
            if found is not None:
                ckpt_path = self.config[subcommand].ckpt_path = str(found)
        asked = self.config[subcommand].model.get("config") if subcommand else None
        asked = dict(asked) if isinstance(asked, dict) else None  # Lightning replaces it with the checkpoint's
        given = model_options(self.config[subcommand].model) if ckpt_path else {}
        base = self.config[subcommand].model.get("init_weights") if ckpt_path else None
        try:
            super()._parse_ckpt_path()
        except Exception as err:  # noqa: BLE001 - torch/zip/unpickling errors alike: re-raised naming the file
            if not ckpt_path:
                raise
            raise ValueError(broken_checkpoint_message(Path(ckpt_path), err)) from err
        if base and self.config[subcommand].model.get("peft"):
            # a LoRA checkpoint holds no base: --model.init_weights given again finds a moved one (fingerprint checked)
            self.config[subcommand].model.init_weights = base
        if ckpt_path and asked is not None:
            refuse_another_architecture(ckpt_path, asked, self.config[subcommand].model.get("config"))
        if ckpt_path and Path(ckpt_path).is_file():
            note_options_the_checkpoint_keeps(ckpt_path, given, model_options(self.config[subcommand].model))

    def instantiate_trainer(self, **kwargs):
        """With no logger configured, log TensorBoard (tb/) and CSV (csv/) under trainer.default_root_dir."""
        loggers = default_loggers(self._get(self.config_init, "trainer", default={}), DEFAULT_ROOT)
        if loggers is not None:
            kwargs["logger"] = loggers
        return super().instantiate_trainer(**kwargs)

    def before_fit(self) -> None:
        """Check the data against the model and that checkpoints can be written, before anything is written."""
        self._resolve_resume()
        root = self.trainer.default_root_dir
        self._log_dirs = [str(logger.log_dir) for logger in self.trainer.loggers if logger.log_dir]
        self._new_folders = missing_folders([root, *self._log_dirs, *(
            cb.dirpath for cb in self.trainer.checkpoint_callbacks if getattr(cb, "dirpath", None))])
        if hasattr(self.datamodule, "check") and getattr(self.model, "model_config", None) is not None:
            self.datamodule.check(self.model.model_config, tuple(self.model.batch_keys))
        directories = [self.trainer.default_root_dir]
        directories += [cb.dirpath for cb in self.trainer.checkpoint_callbacks if getattr(cb, "dirpath", None)]
        for directory in dict.fromkeys(str(d) for d in directories):
            problem = unwritable_reason(Path(directory))
            if problem is not None:
                raise ValueError(
                    f"checkpoint directory {directory} cannot be written ({problem}); choose a writable "
                    "--trainer.default_root_dir or ModelCheckpoint dirpath, or fix the directory's permissions"
                )
        if self.trainer.is_global_zero:
            logs = ", ".join(dict.fromkeys(str(logger.log_dir) for logger in self.trainer.loggers)) or "none"
            checkpoints = ", ".join(str(cb.dirpath) for cb in self.trainer.checkpoint_callbacks) or "none"
            print(f"fit: logs in {logs}; checkpoints in {checkpoints}", flush=True)

    def _resolve_resume(self) -> None:
        """Turn --ckpt_path (a path, or last/best/hpc) into the file it names and set it as trainer.ckpt_path before
        fit, so that the module's setup knows the run resumes: it then neither loads model.init_weights (which may
        be gone) nor says it upcycled them. Lightning itself sets trainer.ckpt_path only after that hook."""
        from lightning.pytorch.trainer.states import TrainerFn

        config = self.config_init[self.subcommand]
        asked = config.get("ckpt_path")
        connector = self.trainer._checkpoint_connector  # Lightning's own resolution of the special values
        resume = connector._parse_ckpt_path(TrainerFn.FITTING, asked, model_provided=True, model_connected=False)
        model_config = getattr(self.model, "hparams", {}).get("config")
        if resume and resume != asked and Path(resume).is_file() and isinstance(model_config, dict):
            # last/best/hpc: Lightning read no hparams from the file, so the model was built from the options
            from fusion_model.checkpoint import checkpoint_config

            try:
                saved = checkpoint_config(resume).to_dict()
            except ValueError:  # a broken file: the restore refuses it naming a good checkpoint
                saved = None
            refuse_another_architecture(str(resume), model_config, saved)
        self.trainer.ckpt_path = resume  # restored by trainer.fit(ckpt_path=None) as Lightning would have
        config["ckpt_path"] = None

    def fit(self, model, **kwargs) -> None:
        """trainer.fit; a start that fails before its first training step removes the folders it made (the log
        folders, an empty checkpoint folder or root): a refused start leaves the run's root as it was."""
        try:
            self.trainer.fit(model, **kwargs)
        except Exception:
            if not getattr(model, "trained_in_this_process", True):
                remove_new_folders(getattr(self, "_new_folders", []), getattr(self, "_log_dirs", []))
            raise

    def after_fit(self) -> None:
        """Save the final step into last.ckpt when the run stopped between periodic checkpoints (max_time or a
        max_steps that is not a multiple of the interval): otherwise up to an interval of training is lost."""
        trainer = self.trainer
        if trainer.interrupted or trainer.global_step == 0:
            return
        for callback in trainer.checkpoint_callbacks:
            saved = getattr(callback, "_last_global_step_saved", None)
            if getattr(callback, "save_last", None) and callback.dirpath and saved != trainer.global_step:
                path = Path(callback.dirpath) / f"{callback.CHECKPOINT_NAME_LAST}{callback.FILE_EXTENSION}"
                # a full checkpoint (optimizer, loops) to resume from; said explicitly, or Lightning logs that
                # "weights_only was not set", which reads like an unsafe load
                trainer.save_checkpoint(path, weights_only=False)
                callback.last_model_path = str(path)
                if trainer.is_global_zero:
                    print(f"fit: saved the final step {trainer.global_step} to {path}", flush=True)

    def before_instantiate_classes(self) -> None:
        """Fill in what the inputs already fix (precision, vocabulary layout, horizon, output paths)."""
        config = self.config.get(self.subcommand, self.config) if self.subcommand else self.config
        if config.trainer.get("precision") is None:
            config.trainer.precision = "bf16-mixed" if torch.cuda.is_available() else "32-true"
        derive_model_config(config)
        derive_family(config)
        fit_schedule_to_time_budget(config)
        place_outputs_under_root(config, DEFAULT_ROOT)
        use_plain_progress_when_logging_to_a_file(config)
        if not getattr(self, "planning", False):  # before any weight exists: a run that cannot fit never starts
            check_before_fit(config)


LAYOUT = ("vocab_size", "image_offset", "image_codes")
DEFAULT_ROOT = "runs/fit"
FIT_HELP = (
    RUNTIME_OPTIONS_HELP + " Taken from the inputs when model.config leaves them out: vocab_size, image_offset and "
    "image_codes (the token shards' manifest, else --vocab), max_seq_len (raised to data.seq_len). "
    "--trainer.max_time without max_steps fits the lr schedule to the time budget. Logs go to "
    "<default_root_dir>/tb and /csv, checkpoints to <default_root_dir>/checkpoints. "
    "--model.family chooses what is trained around the decoder: chameleon (default), "
    + ", ".join(name for name in BUILTIN_FAMILIES if name != "chameleon") + " (the families' registry), "
    "or your own as package.module:Class (CONTRIBUTING.md, 'How to add a model family'), with its options "
    "in --model.family_options '{...}'; --model.late_fusion '{kind: llava, stage: 1}' is the older spelling. "
    "--model.config.block chooses the decoder layer: dense (default), mot (Mixture-of-Transformers: its own FFN, "
    "Q/K/V/O and norms per modality, image codes vs everything else, with global attention; needs the image block), "
    "or your own as package.module:Class; --model.config.block_options '{ffn: true, attention: true, norms: true}' "
    "gives mot's parts a copy per modality (each true unless set false). --model.init_weights DENSE.ckpt with "
    "--model.config.block mot upcycles a dense run: each dense weight starts every modality's copy; its family "
    "must be the run's or chameleon. --checkpoint CKPT (= --ckpt_path) resumes a run with its checkpoint's "
    "architecture (--model.config options naming another one are refused) and loads no --model.init_weights "
    "(with a checkpoint path that file may be gone). "
    "A start refused before its first step removes the log and checkpoint folders it made."
)
STEPS_UNTIL_MEASURED = 1_000_000  # trainer.max_steps under a time budget until TimeBudget has measured the rate


def derive_model_config(config) -> None:
    """Take the vocabulary layout (vocab_size, image_offset, image_codes) the model config leaves unset from the
    token shards' manifest (or `data.vocab`), and raise max_seq_len to `data.seq_len` when unset and too short.

    Only keys absent from model.config are filled in; an explicit value that contradicts the data is left for the
    start-up check, which names both values.
    """
    from fusion_model.config import FusionConfig

    model_config = config.model.get("config")
    if not isinstance(model_config, dict):  # None (config from model.init_weights) or a FusionConfig
        return
    layout: dict[str, int] = {}
    manifest = Path(str(config.data.get("train_dir") or "")) / "manifest.json"
    if manifest.is_file():
        from data_shards.token_shards import read_manifest

        layout = {k: int(v) for k, v in read_manifest(manifest.parent).items() if k in LAYOUT and v is not None}
    vocab_path = config.data.get("vocab")
    if len(layout) < len(LAYOUT) and vocab_path and Path(vocab_path).is_file():
        from tokenizer.vocab import UnifiedVocab

        vocab = UnifiedVocab.load(vocab_path)
        layout = {"vocab_size": vocab.vocab_size, "image_offset": vocab.image_offset, "image_codes": vocab.image_codes,
                  **layout}
    for key, value in layout.items():
        model_config.setdefault(key, value)
    seq_len = config.data.get("seq_len")
    if "max_seq_len" not in model_config and seq_len and FusionConfig.from_dict(model_config).max_seq_len < seq_len:
        model_config["max_seq_len"] = int(seq_len)


def derive_family(config) -> None:
    """Resolve model.family (and the older model.late_fusion spelling) into one family name and its options, and
    let the family fill in what the token shards' manifest (or `data.vocab`) fixes, e.g. a late-fusion family's
    ids and feature width; record the shards' tokenizer fingerprints (model.tokenizers) for `generate` to check."""
    from fusion_model.families import family_class, resolve_family

    name, options = resolve_family(config.model.get("family"), config.model.get("family_options"),
                                   config.model.get("late_fusion"))
    family = family_class(name)
    train_dir = Path(str(config.data.get("train_dir") or ""))
    manifest: dict = {}
    if (train_dir / "manifest.json").is_file():
        from data_shards.datamodule import check_conversations, check_image_kind
        from data_shards.plan import read_index

        manifest = read_index(train_dir).header  # the manifest's fields: no rank parses its O(shards) list
        check_image_kind(str(train_dir), manifest, ("input_ids", *family.batch_keys))  # codes vs latents, first
        check_conversations(str(train_dir), manifest, tuple(family.batch_keys), name)  # answer-only loss needed
    vocab = None
    vocab_path = config.data.get("vocab")
    if vocab_path and Path(vocab_path).is_file():
        from tokenizer.vocab import UnifiedVocab

        vocab = UnifiedVocab.load(vocab_path)
    try:
        family.derive_options(options, manifest, vocab)
    except ValueError as error:
        raise ValueError(f"data.train_dir {train_dir}: {error}") from error
    config.model.family, config.model.family_options, config.model.late_fusion = name, options or None, None
    fingerprints = {"vocab": manifest.get("vocab_fingerprint"),
                    "image_tokenizer": manifest.get("image_tokenizer_fingerprint")}
    if not config.model.get("tokenizers") and any(fingerprints.values()):
        config.model.tokenizers = {key: value for key, value in fingerprints.items() if value}


def fit_schedule_to_time_budget(config) -> None:
    """`--trainer.max_time`: the lr schedule ends when the time does (a TimeBudget callback sets the horizon from
    the measured step rate, never beyond a configured max_steps), instead of being cut off part-way down, or,
    without max_steps, failing for want of a horizon. An explicit --model.decay_steps keeps its own horizon."""
    trainer = config.trainer
    if config.model.get("decay_steps"):
        return
    max_time, max_steps = trainer.get("max_time"), trainer.get("max_steps") or -1
    if not max_time:
        if max_steps > 0:
            return
        raise ValueError("the lr schedule needs a horizon: set --trainer.max_steps N, or --trainer.max_time "
                         "DD:HH:MM:SS to fit the schedule to a time budget (or --model.decay_steps N)")
    callbacks = list(trainer.get("callbacks") or [])
    if not any(str(class_path_of(c)).endswith(".TimeBudget") for c in callbacks):
        minutes = time_limit_seconds(max_time) / 60.0
        callbacks.append(entry("fusion_model.training.callbacks.TimeBudget",
                               {"minutes": minutes, "max_steps": max_steps if max_steps > 0 else None}))
    if max_steps <= 0:
        trainer.max_steps = STEPS_UNTIL_MEASURED
    trainer.callbacks = callbacks


def refuse_another_architecture(ckpt_path: str, asked: dict, resumed) -> None:
    """Refuse --model.config options that name another architecture than the checkpoint to resume holds: a resumed
    run keeps its checkpoint's decoder (Lightning loads its hparams over the command line), so the option would be
    dropped without a word. Only the keys given are compared (a preset's sizes and the layout taken from the data
    are not options the user set)."""
    from fusion_model.checkpoint import architecture_differences
    from fusion_model.config import FusionConfig

    if not isinstance(resumed, dict) or asked == resumed:
        return
    given = {key: value for key, value in asked.items() if key != "preset"}
    have = FusionConfig.from_dict(resumed)
    differences = architecture_differences(have, FusionConfig.from_dict({**resumed, **given}))
    if differences:
        raise ValueError(
            f"--ckpt_path {ckpt_path} holds another decoder than model.config asks for ({'; '.join(differences)}; "
            "checkpoint vs model.config): a resumed run keeps its checkpoint's architecture, so drop those "
            "--model.config options to resume it, or start a new run (without --ckpt_path) for the other one"
        )


# model options a resume never takes from the command line, or whose difference is said elsewhere: the decoder's
# architecture (refused when it differs), the start weights (not read on resume), what `fit` derives from the data
NOT_NOTED_ON_RESUME = ("config", "init_weights", "family", "family_options", "late_fusion", "tokenizers")


def model_options(model) -> dict:
    """The model section's options as plain values (a jsonargparse Namespace or a dict)."""
    values = model.as_dict() if hasattr(model, "as_dict") else dict(model or {})
    return {key: value for key, value in values.items() if key not in NOT_NOTED_ON_RESUME}


def note_options_the_checkpoint_keeps(ckpt_path: str, given: dict, kept: dict) -> None:
    """Say, in one line on stderr, which --model options this command set that the resumed checkpoint overrides
    with its own (a resumed run keeps the recipe it was started with: lr, schedule, loss weights)."""
    differ = [f"{key}={kept.get(key)!r} (this command: {value!r})" for key, value in given.items()
              if value is not None and kept.get(key) != value]
    if differ:
        print(f"fit: resuming {ckpt_path} with its own model options, which win over this command's: "
              f"{', '.join(differ)}; start a new run (without --ckpt_path, e.g. --model.init_weights {ckpt_path}) "
              "to train with other ones", file=sys.stderr, flush=True)


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
            parser_kwargs={"fit": {"epilog": shared_flags_epilog(FIT_SHARED_FLAGS) + "\n\n" + FIT_HELP + " " + PLAN_HELP}},
        )


def main(argv: list[str] | None = None) -> int:
    """Entry point of `train.py fit`; bad input raises ValueError, which `train.py` turns into exit code 2."""
    argv = list(sys.argv[1:] if argv is None else argv)
    argv = take_runtime_options(argv, "fit")
    argv = take_device_memory(argv)
    try:
        fit_from_config(None, translate_shared_flags(argv, FIT_SHARED_FLAGS))
    except NonFiniteLossError as err:  # the run failed after it started: exit 1 (bad input exits 2 in train.py)
        print(f"train.py fit: {err}", file=sys.stderr)
        return 1
    finally:
        end_process_group()
    return 0
