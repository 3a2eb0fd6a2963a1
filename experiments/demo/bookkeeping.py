"""The demo's stage bookkeeping: which config sections each stage reads, its key, its `stage.json` marker."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from pathlib import Path

from common.files import atomic_write_json, atomic_write_text
from experiments.demo.settings import FIT_CONFIG, DemoConfig

# Bumped whenever what a stage writes changes meaning (e.g. the document layout), so old outputs are redone.
# 4: the train stage writes one checkpoint (train/model.ckpt) and runs configs/fusion/demo.yaml.
FORMAT_VERSION = 4
# stage -> the config sections it reads; upstream stages' keys are folded into its own key.
STAGES: dict[str, tuple[str, ...]] = {
    "tokenizer": ("seed", "data", "tokenizer"),
    "vocab": ("seed", "vocab", "tokenizer"),
    "shards": ("seed", "data", "shards"),
    "train": ("seed", "train"),
    "generate": ("seed", "data", "generate"),
    "report": (),
}
UPSTREAM: dict[str, tuple[str, ...]] = {
    "tokenizer": (),
    "vocab": (),
    "shards": ("tokenizer", "vocab"),
    "train": ("shards",),
    "generate": ("train",),
    "report": ("generate",),
}
# stage -> checked-in files it reads besides the demo config: editing one reruns the stage.
FILES: dict[str, tuple[Path, ...]] = {"train": (FIT_CONFIG,)}


def stage_key(config: DemoConfig, stage: str) -> str:
    """A hash of everything the stage's result depends on: its config sections, files and upstream stages."""
    parts: dict[str, object] = {}
    for name in STAGES[stage]:
        value = getattr(config, name)
        parts[name] = dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value
    parts["format"] = FORMAT_VERSION
    parts["files"] = [hashlib.sha256(file.read_bytes()).hexdigest() for file in FILES.get(stage, ())]
    parts["upstream"] = [stage_key(config, up) for up in UPSTREAM[stage]]
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def read_marker(out_dir: Path, stage: str) -> dict | None:
    """The finished stage's record, or None when the stage has not finished."""
    file = out_dir / stage / "stage.json"
    return json.loads(file.read_text()) if file.is_file() else None


def write_marker(out_dir: Path, stage: str, record: dict) -> None:
    """Mark the stage finished with this record (atomically: a marker is whole or absent)."""
    atomic_write_json(out_dir / stage / "stage.json", record)


def is_fresh(out_dir: Path, config: DemoConfig, stage: str) -> bool:
    """True when the stage finished with the current configuration, from the upstream outputs there now."""
    marker = read_marker(out_dir, stage)
    if marker is None or marker.get("key") != stage_key(config, stage):
        return False
    for up in UPSTREAM[stage]:  # an upstream stage rerun since (say with --force) makes this one stale
        upstream = read_marker(out_dir, up)
        if upstream is None or marker.get("inputs", {}).get(up) != upstream.get("run_id"):
            return False
        if not is_fresh(out_dir, config, up):
            return False
    return True


def prepare_folder(folder: Path, key: str, fresh: bool = False) -> None:
    """Keep a stage's partial outputs only when they were made with the same configuration (so it resumes)."""
    key_file = folder / "config_key.txt"
    if folder.exists() and (fresh or not key_file.is_file() or key_file.read_text() != key):
        shutil.rmtree(folder)
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_text(key_file, key)
