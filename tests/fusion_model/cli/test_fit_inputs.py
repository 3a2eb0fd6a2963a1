"""`train.py fit` runs with just the data paths: what the inputs fix is derived, a time budget is a horizon,
outputs land under default_root_dir, checkpoints are bounded, and a log file gets plain progress lines."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from fusion_model import cli
from fusion_model.cli.fit import STEPS_UNTIL_MEASURED, fit_from_config, time_limit_seconds
from fusion_model.training import callbacks as training_callbacks

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "training"))
import fit_worker as fw  # noqa: E402

TINY_YAML = str(fw.REPO / "configs/fusion/tiny.yaml")


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    """Token shards whose manifest records a 256-entry vocabulary with image ids [16, 80)."""
    path = fw.make_token_dir(tmp_path_factory.mktemp("tokens") / "train")
    manifest = json.loads((path / "manifest.json").read_text())
    manifest.update(image_offset=16, image_codes=64)
    (path / "manifest.json").write_text(json.dumps(manifest))
    return path


def _built(tokens: Path, root: Path, *extra: str):
    """The CLI object of `train.py fit` with only data paths and a root (nothing trained)."""
    return fit_from_config(TINY_YAML, [f"--data.train_dir={tokens}", f"--trainer.default_root_dir={root}",
                                       "--data.seq_len=32", *extra], run=False)


def test_the_vocabulary_layout_comes_from_the_shards(tokens, tmp_path):
    config = _built(tokens, tmp_path).model.model_config
    assert (config.vocab_size, config.image_offset, config.image_codes) == (256, 16, 64)


def test_a_too_short_context_is_raised_to_the_sequence_length_unless_given(tokens, tmp_path):
    assert _built(tokens, tmp_path, "--data.seq_len=256").model.model_config.max_seq_len == 256
    assert _built(tokens, tmp_path, "--data.seq_len=16").model.model_config.max_seq_len == 128  # the preset's


def test_an_explicit_value_that_contradicts_the_shards_names_both(tokens, tmp_path, capsys):
    code = cli.main(["fit", "--config", TINY_YAML, f"--data.train_dir={tokens}", "--data.seq_len=32",
                     f"--trainer.default_root_dir={tmp_path}", "--model.config.image_codes=32", "--threads=1"])
    err = capsys.readouterr().err
    assert code == 2
    assert "model.config.image_codes=32" in err and "image_codes 64" in err and str(tokens) in err
    assert list(tmp_path.iterdir()) == [], "a refused start leaves no empty log or checkpoint folders"


def test_max_time_alone_fits_the_schedule_to_the_budget(tokens, tmp_path):
    built = _built(tokens, tmp_path, "--trainer.max_steps=-1", "--trainer.max_time=00:00:02:30")
    budgets = [c for c in built.trainer.callbacks if isinstance(c, training_callbacks.TimeBudget)]
    assert len(budgets) == 1 and budgets[0].seconds == 150
    assert built.trainer.max_steps == STEPS_UNTIL_MEASURED


def test_max_time_with_max_steps_ends_the_schedule_at_whichever_comes_first(tokens, tmp_path):
    built = _built(tokens, tmp_path, "--trainer.max_steps=2000", "--trainer.max_time=00:00:06:00")
    budget = next(c for c in built.trainer.callbacks if isinstance(c, training_callbacks.TimeBudget))
    assert (budget.seconds, budget.max_steps, built.trainer.max_steps) == (360, 2000, 2000)
    assert not any(isinstance(c, training_callbacks.TimeBudget)
                   for c in _built(tokens, tmp_path, "--trainer.max_steps=20").trainer.callbacks), "no time limit"


def test_max_steps_auto_is_accepted_on_the_command_line(tokens, tmp_path, capsys):
    code = cli.main(["fit", "--config", TINY_YAML, f"--data.train_dir={tokens}", "--data.seq_len=32",
                     f"--trainer.default_root_dir={tmp_path}", "--trainer.max_steps", "auto", "--threads=1"])
    assert code == 2
    err = capsys.readouterr().err
    assert "needs a horizon" in err and "--trainer.max_time" in err, "auto without a time budget: one line"


@pytest.mark.parametrize("value, seconds", [("00:01:02:03", 3723), ({"minutes": 2, "seconds": 5}, 125)])
def test_time_limits_in_lightnings_forms(value, seconds):
    assert time_limit_seconds(value) == seconds


def test_a_malformed_time_limit_names_the_flag():
    with pytest.raises(ValueError, match="--trainer.max_time '90 minutes'"):
        time_limit_seconds("90 minutes")


def test_every_output_goes_under_default_root_dir(tokens, tmp_path):
    trainer = _built(tokens, tmp_path / "run").trainer
    assert [Path(logger.save_dir) for logger in trainer.loggers] == [tmp_path / "run"] * 2
    assert Path(trainer.checkpoint_callback.dirpath) == tmp_path / "run" / "checkpoints"


def test_a_log_file_gets_plain_progress_lines_and_a_terminal_the_bar(tokens, tmp_path, monkeypatch):
    monkeypatch.setattr(training_callbacks, "stdout_is_terminal", lambda: False)
    kinds = [type(c).__name__ for c in _built(tokens, tmp_path).trainer.callbacks]
    assert "PlainTextProgress" in kinds and "RichProgressBar" not in kinds
    monkeypatch.setattr(training_callbacks, "stdout_is_terminal", lambda: True)
    kinds = [type(c).__name__ for c in _built(tokens, tmp_path).trainer.callbacks]
    assert "RichProgressBar" in kinds and "PlainTextProgress" not in kinds


def test_a_short_run_keeps_two_checkpoints_and_says_its_threads(tokens, tmp_path, capsys):
    code = cli.main(["fit", "--config", TINY_YAML, f"--data.train_dir={tokens}", "--data.seq_len=32",
                     f"--trainer.default_root_dir={tmp_path}", "--trainer.max_steps=30", "--threads=1",
                     "--trainer.enable_progress_bar=false", "--trainer.limit_val_batches=0"])
    assert code == 0
    out = capsys.readouterr().out
    assert "fit on 1 CPU thread (--threads)" in out
    assert f"fit: logs in {tmp_path / 'tb' / 'version_0'}, {tmp_path / 'csv' / 'version_0'}; checkpoints in " \
        f"{tmp_path / 'checkpoints'}" in out
    kept = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert kept == ["epoch=3-step=30.ckpt", "last.ckpt"], "tiny saves every 10 steps and keeps the latest"


def test_a_run_that_stops_between_checkpoints_saves_its_last_step_and_resumes_exactly(tokens, tmp_path):
    """tiny.yaml saves every 10 steps: a 13-step run still leaves step 13 in last.ckpt, and 13 + 4 resumed steps
    equal 17 uninterrupted ones bit for bit (one lr horizon for all three runs: --model.decay_steps 17)."""
    import torch

    def fit(root: Path, steps: int, *extra: str) -> dict:
        args = [f"--config={TINY_YAML}", f"--data.train_dir={tokens}", "--data.seq_len=32", "--data.num_workers=0",
                f"--trainer.default_root_dir={root}", f"--trainer.max_steps={steps}", "--threads=1",
                "--trainer.enable_progress_bar=false", "--trainer.limit_val_batches=0", "--model.decay_steps=17",
                fw.recorder_arg(root / "rec"), *extra]
        assert cli.main(["fit", *args]) == 0
        return torch.load(root / "rec.rank0.pt", weights_only=True)

    whole = fit(tmp_path / "whole", 17)
    fit(tmp_path / "cut", 13)
    last = tmp_path / "cut" / "checkpoints" / "last.ckpt"
    assert torch.load(last, weights_only=True)["global_step"] == 13
    resumed = fit(tmp_path / "cut", 17, f"--checkpoint={last}")
    assert resumed["losses"] == whole["losses"][13:]
    for name, value in whole["weights"].items():
        assert torch.equal(resumed["weights"][name], value), name
