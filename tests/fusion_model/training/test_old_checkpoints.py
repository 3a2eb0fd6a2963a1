"""Checkpoints that `train.py fit` wrote before the restructuring still work with the code as it is now.

The fixture (tests/fixtures/checkpoints/tiny-d9f92c4, see its README.md) holds three real `fit` checkpoints
written by commit d9f92c4 after 3 steps: a dense Chameleon decoder, a Mixture-of-Transformers one and a
Transfusion one (with their optimizer state, lr schedule, loops, loader position and RNG states), beside the
token shards, vocabulary and image tokenizers they were trained with. It stands for checkpoints users already
have: never regenerate it with new code. For each checkpoint this proves that
- `load_family` builds its family and loads exactly the file's weights into the family's parts;
- `train.py fit --ckpt_path` resumes it at its step 3 (optimizer, schedule and loader position restored, not
  restarted) and trains 2 more steps on the same rows to the losses the old code trained it to;
- `train.py generate` samples text and images from it;
- the class paths its saved run config names still import, and the fixture is the old code's bytes.
Every test reads the fixture only; what runs on it runs on a copy in tmp_path.
"""

from __future__ import annotations

import csv
import hashlib
import importlib
import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from PIL import Image

from fusion_model import cli
from fusion_model.families.loading import load_family

REPO = Path(__file__).resolve().parents[3]
FIXTURE = REPO / "tests" / "fixtures" / "checkpoints" / "tiny-d9f92c4"
VOCAB_SIZE, STEPS_SAVED, MORE_STEPS = 320, 3, 2

# each checkpoint: its family, the shards and image tokenizer it was trained with, and its own `fit` options
RUNS = {
    "chameleon-dense": ("chameleon", "tokens", "vq", []),
    "chameleon-mot": ("chameleon", "tokens", "vq", ["--model.config.block", "mot"]),
    "transfusion": ("transfusion", "tokens-latents", "kl", ["--model.family", "transfusion"]),
}
# the `fit` options every checkpoint was written with (README.md), but --trainer.max_steps
FIT = ["--model.config.vocab_size", str(VOCAB_SIZE), "--model.config.dim", "16",
       "--model.config.n_layers", "2", "--model.config.n_heads", "2", "--model.config.n_kv_heads", "1",
       "--model.config.ffn_dim", "32",
       "--model.config.max_seq_len", "64", "--data.seq_len", "32", "--data.batch_size", "2",
       "--trainer.val_check_interval", "null", "--trainer.limit_val_batches", "0",
       "--trainer.enable_progress_bar", "false", "--threads", "1"]

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: one torch thread, restored after


@pytest.fixture
def fixture(tmp_path) -> Path:
    """A copy of the fixture (fit writes its shard plans into the token directories)."""
    return Path(shutil.copytree(FIXTURE, tmp_path / "fixture"))


def read(path: Path) -> dict:
    return torch.load(path, weights_only=True, map_location="cpu")


@pytest.mark.parametrize("run", sorted(RUNS))
def test_load_family_loads_the_weights_of_an_old_checkpoint(run, fixture):
    family, *_ = RUNS[run]
    path = fixture / run / "last.ckpt"
    checkpoint = read(path)
    loaded = load_family(path)
    assert loaded.family.name == family
    assert loaded.tokenizers == checkpoint["hyper_parameters"]["tokenizers"]  # the fingerprints it had
    weights = {f"{part}.{key}": value for part, module in loaded.parts.items()
               for key, value in module.state_dict().items()}
    assert sorted(weights) == sorted(checkpoint["state_dict"])  # every weight of the file, and no other
    for name, value in checkpoint["state_dict"].items():
        assert torch.equal(weights[name], value), name
    assert not any(module.training for module in loaded.parts.values())


def fit_argv(run: str, fixture: Path, root: Path, max_steps: int) -> list[str]:
    """The `train.py fit` command that wrote the fixture's `run`, with another max_steps and root."""
    _, tokens, image_tokenizer, extra = RUNS[run]
    return ["fit", "--config", str(REPO / "configs/fusion/tiny.yaml"),
            "--vocab", str(fixture / "vocab/tokenizer.json"), *FIT, "--data.train_dir", str(fixture / tokens),
            "--image-tokenizer", str(fixture / image_tokenizer), *extra, f"--trainer.max_steps={max_steps}",
            "--trainer.default_root_dir", str(root)]


def logged(root: Path, names: set[str]) -> dict[str, dict[str, float]]:
    """step -> {metric: value} of the CSV log under `root`, for the metrics in `names`."""
    (metrics,) = root.rglob("metrics.csv")
    with metrics.open() as handle:
        rows = list(csv.DictReader(handle))
    return {row["step"]: {k: float(v) for k, v in row.items() if v and k in names} for row in rows}


@pytest.mark.parametrize("run", sorted(RUNS))
def test_fit_resumes_an_old_checkpoint_where_it_stopped(run, fixture, tmp_path):
    old_path = fixture / run / "last.ckpt"
    old = read(old_path)
    assert old["global_step"] == STEPS_SAVED
    root = tmp_path / "resumed"
    argv = [*fit_argv(run, fixture, root, STEPS_SAVED + MORE_STEPS), "--ckpt_path", str(old_path)]
    assert cli.main(argv) == 0

    (new_path,) = root.rglob("last.ckpt")
    new = read(new_path)
    assert new["global_step"] == STEPS_SAVED + MORE_STEPS
    # the optimizer's and the schedule's counts are the run's (a fresh optimizer would count 2; the logged
    # steps and metrics below also fail for a run that starts again at step 0)
    steps = {int(state["step"]) for state in new["optimizer_states"][0]["state"].values()}
    assert steps == {STEPS_SAVED + MORE_STEPS}
    assert new["lr_schedulers"][0]["last_epoch"] == STEPS_SAVED + MORE_STEPS
    assert new["hyper_parameters"]["config"] == old["hyper_parameters"]["config"]
    assert new["hyper_parameters"]["family_options"] == old["hyper_parameters"]["family_options"]

    # what the old code's resume of the same checkpoint did (README.md: resume.json): the same loader position
    # (the same rows of the same shards) and, at each step, the same losses, gradient norm and lr
    expected = json.loads((fixture / run / "resume.json").read_text())
    assert new["loops"]["fit_loop"]["state_dict"]["combined_loader"] == expected["combined_loader"]
    metrics = logged(root, {name for step in expected["metrics"].values() for name in step})
    assert sorted(metrics) == [str(s) for s in range(STEPS_SAVED, STEPS_SAVED + MORE_STEPS)]  # on from 3
    for step, values in expected["metrics"].items():
        # 1e-4: another CPU's kernels may round a little differently; a wrong resume is off by far more
        assert metrics[step] == pytest.approx(values, rel=1e-4), step


GENERATE = [("chameleon-dense", "text"), ("chameleon-dense", "image"), ("chameleon-mot", "image"),
            ("transfusion", "image")]


@pytest.mark.parametrize(("run", "mode"), GENERATE, ids=[f"{run}-{mode}" for run, mode in GENERATE])
def test_generate_samples_from_an_old_checkpoint(run, mode, fixture, tmp_path):
    family, _, image_tokenizer, _ = RUNS[run]
    out = tmp_path / "samples"
    argv = ["generate", "--checkpoint", str(fixture / run / "last.ckpt"),
            "--vocab", str(fixture / "vocab/tokenizer.json"),
            "--image-tokenizer", str(fixture / image_tokenizer),
            "--prompt", "a red circle", "--mode", mode, "--out", str(out)]
    argv += ["--max-new-tokens", "3"] if mode == "text" else []
    argv += ["--denoising-steps", "2"] if family == "transfusion" else []
    assert cli.main(argv) == 0
    (sample,) = json.loads((out / "samples.json").read_text())["samples"]
    assert 1 <= len(sample["ids"]) <= (3 if mode == "text" else 32)
    assert all(0 <= i < VOCAB_SIZE for i in sample["ids"])
    if mode == "image":
        (image,) = [part for part in sample["output"] if "image" in part]
        with Image.open(out / image["image"]) as png:
            assert png.size == (8, 8)  # the image tokenizers' 8 px
        if family == "chameleon":  # <boi>, 2x2 codes of the vocabulary's image block (ids 16..31), <eoi>
            assert sample["ids"][0] == 3 and sample["ids"][-1] == 4 and len(sample["ids"]) == 6
            assert all(16 <= i < 32 for i in sample["ids"][1:-1])


def class_paths(node) -> list[str]:
    """Every `class_path` value in a parsed YAML tree."""
    if isinstance(node, dict):
        own = [node["class_path"]] if "class_path" in node else []
        return own + [path for value in node.values() for path in class_paths(value)]
    if isinstance(node, list):
        return [path for value in node for path in class_paths(value)]
    return []


def test_the_class_paths_the_old_runs_saved_still_import():
    """Each run's config.yaml (LightningCLI's record of the run, what `--config` reruns) names classes by
    module path: moving one of those modules without leaving its name importable breaks every saved config."""
    configs = [yaml.safe_load((FIXTURE / run / "config.yaml").read_text()) for run in RUNS]
    paths = {path for config in configs for path in class_paths(config)}
    assert "fusion_model.training.checkpointing.AtomicCheckpointIO" in paths
    for path in sorted(paths):
        module, _, name = path.rpartition(".")
        assert isinstance(getattr(importlib.import_module(module), name), type), path


def test_the_fixture_is_the_one_the_old_code_wrote():
    """SHA256SUMS was written with the fixture: a fixture regenerated (or written into) by newer code would no
    longer stand for the checkpoints users have."""
    lines = (FIXTURE / "SHA256SUMS").read_text().splitlines()
    listed = {name: digest for digest, name in (line.split("  ", 1) for line in lines)}
    files = {p.relative_to(FIXTURE).as_posix() for p in FIXTURE.rglob("*") if p.is_file()}
    assert set(listed) == files - {"README.md", "SHA256SUMS"}
    for name, digest in listed.items():
        assert hashlib.sha256((FIXTURE / name).read_bytes()).hexdigest() == digest, name
