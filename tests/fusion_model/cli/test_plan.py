"""`train.py plan` prints the memory plan of fit's options; `train.py fit` stops before building the model when the
plan exceeds the device (exit 2, nothing written), unless told `--plan.force true`."""

import functools
import sys
from pathlib import Path

import pytest

from fusion_model import cli
from fusion_model.training.lightning_module import FusionLightningModule

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "training"))
import fit_worker as fw  # noqa: E402


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    return fw.make_token_dir(tmp_path_factory.mktemp("tokens") / "train")


@pytest.fixture
def never_built(monkeypatch):
    original = FusionLightningModule.__init__

    @functools.wraps(original)  # the parser reads the signature: keep it
    def refuse(self, *args, **kwargs):
        raise AssertionError("the Lightning module was constructed")

    monkeypatch.setattr(FusionLightningModule, "__init__", refuse)


def test_plan_prints_every_line_for_a_preset(capsys, never_built):
    assert cli.main(["plan", "--model.config.preset", "small", "--data.batch_size", "2", "--data.seq_len", "256",
                     "--device-memory", "4"]) == 0
    out = capsys.readouterr().out
    for line in ("parameters", "gradients", "optimizer states", "master weights", "activations", "logits / loss chunk",
                 "attention scratch", "KV cache for sampling", "total (peak)", "fits"):
        assert line in out, line
    assert "5,511,424 x 4 B" in out  # the small preset's parameters, fp32 on CPU


def test_plan_of_a_run_that_does_not_fit_says_what_to_change(capsys, never_built):
    args = ["plan", "--model.config.preset", "small", "--data.batch_size", "8", "--data.seq_len", "512",
            "--device-memory", "0.25"]
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert "--data.batch_size" in err and "--model.activation_checkpointing true" in err and "GiB" in err


def test_fit_stops_before_building_the_model_when_the_device_is_too_small(tokens, tmp_path, capsys, never_built):
    root = tmp_path / "run"
    assert cli.main(["fit", *fw.tiny_args(tokens, root, 2), "--device-memory", "0.0001"]) == 2
    err = capsys.readouterr().err
    assert "memory plan" in err and "--plan.force true" in err
    assert not root.exists()  # no log, checkpoint or config folder


def test_plan_force_starts_anyway(tokens, tmp_path, monkeypatch):
    from fusion_model.cli import memory_check

    seen = []
    original = memory_check.check_before_fit
    monkeypatch.setattr(memory_check, "check_before_fit", lambda config: seen.append(original(config)))
    from fusion_model.cli import fit

    monkeypatch.setattr(fit, "check_before_fit", memory_check.check_before_fit)
    cli_object = fit.fit_from_config(None, [*fw.tiny_args(tokens, tmp_path / "run", 1), "--plan.device_memory=0.0001",
                                            "--plan.force=true"], run=False)
    assert not seen[0].fits and cli_object.model is not None  # planned, refused by the plan, built anyway
