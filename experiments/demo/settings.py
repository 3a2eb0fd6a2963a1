"""The demo's options: a typed dataclass per section of configs/demo/*.yaml, checked by jsonargparse."""

from __future__ import annotations

import argparse
import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from jsonargparse import ArgumentParser

REPO_ROOT = Path(__file__).resolve().parents[2]
CONFIG_DIR = REPO_ROOT / "configs" / "demo"
# The train stage runs `train.py fit` with this config plus the demo's overrides (experiments.demo.stages).
FIT_CONFIG = REPO_ROOT / "configs" / "fusion" / "demo.yaml"


@dataclass
class DataSettings:
    """The MNIST split and the documents written from it."""

    held_out: int  # digits never seen in training
    train_limit: int | None  # None: every remaining digit
    image_size: int
    captions_per_image: int  # each training digit is written this many times
    augment: bool  # copies after the first are randomly rotated, scaled and shifted
    arithmetic_documents: int


@dataclass
class TokenizerSettings:
    """Stage 1: the VQ image tokenizer."""

    preset: str  # an ImageTokenizerConfig preset
    max_minutes: float
    max_steps: int
    batch_size: int
    overrides: dict[str, Any] = field(default_factory=dict)  # ImageTokenizerConfig fields over the preset's


@dataclass
class VocabSettings:
    """Stage 2: the unified vocabulary."""

    vocab_size: int
    english_lines: int  # KJV verses the BPE is trained on (plus every caption)


@dataclass
class ShardsSettings:
    """Stage 3: raw and token shards."""

    flip_probability: float  # caption->image vs image->caption
    samples_per_shard: int


@dataclass
class TrainSettings:
    """Stage 4: `train.py fit` with configs/fusion/demo.yaml; a None field keeps that file's value."""

    max_minutes: float
    max_steps: int | Literal["auto"]  # auto: as many as fit in max_minutes (the lr decay then ends on time)
    seq_len: int | None = None  # data.seq_len and model.config.max_seq_len
    batch_size: int | None = None  # data.batch_size
    lr: float | None = None  # model.lr
    warmup_steps: int | None = None  # model.warmup_steps
    weight_decay: float | None = None  # model.weight_decay
    dropout: float | None = None  # model.config.dropout
    log_every: int | None = None  # trainer.log_every_n_steps (the recorded loss curves follow it)


@dataclass
class GenerateSettings:
    """Stage 5: the classifier, sampling and the held-out evaluation."""

    classifier_epochs: int
    images_per_caption: int
    understanding_examples: int
    arithmetic_examples: int
    temperature: float
    top_k: int
    cfg_scale: float
    samples_shown: int  # images per caption in the report


@dataclass
class DemoConfig:
    """Every option of the demo; stage keys hash the sections each stage reads (demo.bookkeeping)."""

    out_dir: str
    seed: int
    threads: int | Literal["auto"]  # torch threads; auto: the cores other processes leave idle
    data: DataSettings
    tokenizer: TokenizerSettings
    vocab: VocabSettings
    shards: ShardsSettings
    train: TrainSettings
    generate: GenerateSettings
    source: str = ""  # the YAML it was read from (load_config sets it; the report's rerun commands show it)


def shown_path(path: str | Path) -> str:
    """A path as rerun commands show it: relative to the working directory where possible."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(Path(path).resolve())


def _parser() -> ArgumentParser:
    """A jsonargparse parser over DemoConfig; errors raise instead of exiting."""
    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(DemoConfig, "demo")
    return parser


def _check_key(item: str) -> None:
    """Raise a clear error unless the `--set` item is `key=value` with a key naming a DemoConfig field."""
    key, sep, _ = item.partition("=")
    if not sep:
        raise ValueError(f"--set {item!r}: expected section.key=value, e.g. train.max_minutes=2")
    cls: Any = DemoConfig
    *parents, leaf = key.split(".")
    for part in parents:
        section = typing.get_type_hints(cls).get(part)
        if not (isinstance(section, type) and dataclasses.is_dataclass(section)):
            raise ValueError(f"--set {item!r}: no config section {part!r}")
        cls = section
    known = [f.name for f in dataclasses.fields(cls)]
    if leaf not in known:
        raise ValueError(f"--set {item!r}: unknown key {leaf!r}; known: {known}")


def load_config(preset: str = "full", path: str | Path | None = None,
                overrides: list[str] | None = None) -> DemoConfig:
    """Read a demo YAML (a preset name in configs/demo, or a path) and apply `section.key=value` overrides."""
    file = Path(path) if path else CONFIG_DIR / f"{preset}.yaml"
    if not file.is_file():
        names = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))
        raise FileNotFoundError(f"demo config {file} not found; presets are {names}, or pass --config PATH")
    values = {**(yaml.safe_load(file.read_text()) or {}), "source": shown_path(file)}
    for item in overrides or []:
        _check_key(item)
    parser = _parser()
    try:
        parsed = parser.parse_object({"demo": values})
        if overrides:  # jsonargparse parses each value as its field's type (YAML syntax: null, {a: 1}, [1, 2])
            parsed = parser.parse_args([f"--demo.{item}" for item in overrides], namespace=parsed)
        return parser.instantiate(parsed).demo
    except argparse.ArgumentError as error:  # one line, with the keys as the YAML and --set name them
        message = " ".join(line.strip() for line in str(error).splitlines()).replace('"demo.', '"')
        given = f" with --set {' '.join(overrides)}" if overrides else ""
        raise ValueError(f"demo config {shown_path(file)}{given}: {message}") from None

