"""Options shared by the LightningCLI commands (`fit`, `tokenizer fit`): `--threads`, `--trainer.max_steps auto`,
time limits, checkpoints under the run folder, and plain progress lines instead of a bar when output goes to a file."""

from __future__ import annotations

import shutil
from collections.abc import Iterable
from pathlib import Path

from common.threads import choose_threads


def take_option(argv: list[str], flag: str, default: str | None) -> tuple[str | None, list[str]]:
    """The value of the last `flag X` / `flag=X` in argv (else `default`), and argv without it."""
    value, rest, index = default, [], 0
    while index < len(argv):
        arg = argv[index]
        if arg == "--":
            rest += argv[index:]
            break
        if arg == flag:
            if index + 1 >= len(argv):
                raise ValueError(f"{flag} needs a value")
            value, index = argv[index + 1], index + 2
            continue
        if arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
        else:
            rest.append(arg)
        index += 1
    return value, rest


def time_limit_seconds(max_time) -> float:
    """Seconds in a Lightning `max_time`: "DD:HH:MM:SS", a {days, hours, minutes, seconds} dict or a timedelta."""
    if hasattr(max_time, "total_seconds"):
        return float(max_time.total_seconds())
    if hasattr(max_time, "get"):
        units = {"days": 86400, "hours": 3600, "minutes": 60, "seconds": 1}
        return float(sum(float(max_time.get(k) or 0) * v for k, v in units.items()))
    parts = str(max_time).split(":")
    try:
        days, hours, minutes, seconds = (float(p) for p in parts)
    except ValueError:
        raise ValueError(f"--trainer.max_time {max_time!r}: write it as DD:HH:MM:SS, e.g. 00:02:30:00") from None
    return ((days * 24 + hours) * 60 + minutes) * 60 + seconds


PROGRESS_BARS = (".RichProgressBar", ".TQDMProgressBar")


def use_plain_progress_when_logging_to_a_file(config) -> None:
    """With stdout not a terminal (a cluster job, nohup, `> log`), replace the progress bar by a plain line every
    30 seconds (steps, tokens/s, loss, ETA): a bar in a log file prints one line after minutes of silence."""
    from fusion_model.training.callbacks import stdout_is_terminal

    trainer = config.trainer
    if trainer.get("enable_progress_bar") is False:  # also drops the config's bar, which Lightning would refuse
        trainer.callbacks = [c for c in trainer.get("callbacks") or [] if not str(class_path_of(c)).endswith(PROGRESS_BARS)]
        return
    if stdout_is_terminal():
        return
    callbacks = [c for c in trainer.get("callbacks") or [] if not str(class_path_of(c)).endswith(PROGRESS_BARS)]
    if not any(str(class_path_of(c)).endswith(".PlainTextProgress") for c in callbacks):
        callbacks.append(entry("fusion_model.training.callbacks.PlainTextProgress", {}))
    trainer.callbacks = callbacks
    trainer.enable_progress_bar = False


def place_outputs_under_root(config, default_root: str) -> None:
    """ModelCheckpoints without a dirpath write to <trainer.default_root_dir>/checkpoints (the default loggers
    write under the root too: `instantiate_trainer`), so one flag moves every output of a run."""
    trainer = config.trainer
    root = str(trainer.get("default_root_dir") or default_root)
    for callback in trainer.get("callbacks") or []:
        init = init_args_of(callback)
        if str(class_path_of(callback)).endswith(".ModelCheckpoint") and init is not None and not init.get("dirpath"):
            init["dirpath"] = str(Path(root) / "checkpoints")


def last_checkpoint(config, default_root: str) -> Path | None:
    """The newest `last*.ckpt` in the checkpoint folders the config names (each ModelCheckpoint's dirpath, or
    <trainer.default_root_dir>/checkpoints when it names none): the file `--ckpt_path last` resumes, found before the
    trainer exists so that its hyperparameters are read from it as from a path (Lightning resolves `last` only after
    building the model from the command line's options, which then won over the checkpoint's)."""
    trainer = config.trainer
    root = Path(str(trainer.get("default_root_dir") or default_root))
    folders = []
    for callback in trainer.get("callbacks") or []:
        init = init_args_of(callback)
        if str(class_path_of(callback)).endswith(".ModelCheckpoint"):
            folders.append(Path(str((init or {}).get("dirpath") or root / "checkpoints")))
    found = [path for folder in dict.fromkeys(folders) if folder.is_dir() for path in folder.glob("last*.ckpt")
             if path.is_file()]
    return max(found, key=lambda path: path.stat().st_mtime_ns) if found else None


def missing_folders(paths: Iterable[str | Path]) -> list[Path]:
    """Each of `paths` and those of its parents that do not exist yet, deepest first: what a start will create."""
    missing: set[Path] = set()
    for path in paths:
        folder = Path(path).absolute()
        while not folder.exists() and folder != folder.parent:
            missing.add(folder)
            folder = folder.parent
    return sorted(missing, key=lambda folder: len(folder.parts), reverse=True)


def remove_new_folders(missing: Iterable[Path], log_dirs: Iterable[str | Path]) -> None:
    """Remove what a refused start made of the folders `missing` held before it: a log folder whole (all in it is
    the start's: event file, hparams, config), any other only when empty, so that nothing else is ever deleted."""
    whole = {Path(folder).absolute() for folder in log_dirs}
    for folder in missing:  # deepest first, so that a parent is empty once its new children are gone
        if not folder.is_dir():
            continue
        if folder in whole:
            shutil.rmtree(folder, ignore_errors=True)
            continue
        try:
            folder.rmdir()
        except OSError:  # not empty: something else writes there
            pass


def default_loggers(trainer_config, default_root: str) -> list | None:
    """TensorBoard (tb/) and CSV (csv/) under trainer.default_root_dir when the config names no logger, else None."""
    if trainer_config.get("logger") not in (None, True):
        return None
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    root = trainer_config.get("default_root_dir") or default_root
    return [TensorBoardLogger(root, name="tb"), CSVLogger(root, name="csv")]


def class_path_of(item) -> str | None:
    """The class path of a callback/logger entry, or of an already instantiated object."""
    return item.get("class_path") if hasattr(item, "get") else type(item).__module__ + "." + type(item).__name__


def init_args_of(item):
    """The init_args mapping of a `class_path` entry (created if missing), or None for an instantiated object."""
    if not hasattr(item, "get") or item.get("class_path") is None:
        return None
    if item.get("init_args") is None:
        item["init_args"] = type(item)() if not isinstance(item, dict) else {}
    return item["init_args"]


def entry(class_path: str, init_args: dict):
    """A `class_path` entry as the parser makes them."""
    from jsonargparse import Namespace

    return Namespace(class_path=class_path, init_args=Namespace(**init_args))


def take_runtime_options(argv: list[str], what: str) -> list[str]:
    """Apply `--threads auto|N` (unless only help or the config is printed) and turn `--trainer.max_steps auto`
    into -1 (no step limit: the time budget decides); return the remaining LightningCLI arguments."""
    threads, argv = take_option(argv, "--threads", "auto")
    if not any(a in ("-h", "--help", "--print_config") or a.startswith("--print_config=") for a in argv):
        choose_threads(threads, what=what)
    steps, argv = take_option(argv, "--trainer.max_steps", None)
    if steps is not None:
        argv.append(f"--trainer.max_steps={-1 if steps == 'auto' else steps}")
    return argv


def end_process_group() -> None:
    """Destroy torch.distributed's process group, if a multi-process run made one. Lightning leaves it to
    interpreter exit, where a gloo rank sometimes aborts with "terminate called without an active exception"
    (seen about once in 15 two-process runs on a loaded CPU) after training has finished."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


RUNTIME_OPTIONS_HELP = (
    "--threads auto|N: CPU threads (auto: the cores other processes leave idle, measured at start). "
    "--trainer.max_steps auto: no step limit, --trainer.max_time decides. With stdout not a terminal the "
    "progress bar becomes a plain line every 30 s (steps, throughput, loss, ETA)."
)
