"""FusionLightningModule options: activation checkpointing, compile, hparams, precision default, schedule horizon."""

import sys
from pathlib import Path

import pytest
import torch

from fusion_model.config import FusionConfig
from fusion_model.training.lightning_module import FusionLightningModule

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fit_worker as fw  # noqa: E402


def _grads(module: FusionLightningModule, batch: dict) -> dict[str, torch.Tensor]:
    module.zero_grad()
    objective = module.objective(batch)
    objective.loss(objective.counts()).backward()
    return {n: p.grad.clone() for n, p in module.named_parameters()}


def _batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(1, 256, (2, 32))
    docs = torch.cat([torch.zeros(2, 20, dtype=torch.long), torch.ones(2, 12, dtype=torch.long)], dim=1)
    return {"input_ids": ids, "document_ids": docs}


def test_activation_checkpointing_gives_the_same_gradients():
    config = FusionConfig(**fw.TINY)
    torch.manual_seed(0)
    plain = FusionLightningModule(config)
    torch.manual_seed(0)
    recomputed = FusionLightningModule(config, activation_checkpointing=True)
    assert recomputed.model.config.gradient_checkpointing and not plain.model.config.gradient_checkpointing
    batch = _batch()
    expected, got = _grads(plain, batch), _grads(recomputed, batch)
    assert expected.keys() == got.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=0, msg=name)
        assert got[name].abs().sum() > 0, name  # gradient reaches every parameter


def test_compile_option_compiles_each_block_in_place():
    module = FusionLightningModule(FusionConfig(**fw.TINY), compile=True)
    names = [n for n, _ in module.named_parameters()]
    module.configure_model()
    assert all(block._compiled_call_impl is not None for block in module.model.layers)
    assert [n for n, _ in module.named_parameters()] == names  # checkpoints keep their keys


def test_hyperparameters_are_plain_values_and_rebuild_the_module():
    module = FusionLightningModule(FusionConfig(**fw.TINY), lr=3e-4, lr_schedule="cosine")
    assert module.hparams["config"] == FusionConfig(**fw.TINY).to_dict()
    again = FusionLightningModule(**module.hparams)
    assert again.model_config == module.model_config and again.hparams.lr == 3e-4
    with pytest.raises(ValueError, match="nonfinite='ignore'"):
        FusionLightningModule(FusionConfig(**fw.TINY), nonfinite="ignore")


def test_config_by_preset_name_plus_overrides_stores_the_resolved_dict(tmp_path):
    module = FusionLightningModule({"preset": "tiny", "dropout": 0.1, "max_seq_len": 64})
    expected = FusionConfig.from_preset("tiny", dropout=0.1, max_seq_len=64)
    assert module.model_config == expected and module.hparams["config"] == expected.to_dict()
    torch.save({"hyper_parameters": dict(module.hparams)}, tmp_path / "hparams.pt")
    stored = torch.load(tmp_path / "hparams.pt", weights_only=True)["hyper_parameters"]
    assert stored["config"] == expected.to_dict()  # every field, so a later change to a preset cannot alter it
    assert FusionLightningModule(**stored).model_config == expected


def test_precision_defaults_to_fp32_on_cpu_and_the_schedule_needs_a_horizon(tmp_path):
    from fusion_model.cli.fit import fit_from_config

    tokens = fw.make_token_dir(tmp_path / "tokens")
    args = fw.tiny_args(tokens, tmp_path, 5)
    cli = fit_from_config(None, [*args, "--trainer.precision=null"], run=False)
    assert cli.trainer.precision == ("bf16-mixed" if torch.cuda.is_available() else "32-true")
    with pytest.raises(ValueError, match="needs a horizon: set --trainer.max_steps N, or --trainer.max_time"):
        fit_from_config(None, [*args, "--trainer.max_steps=-1", "--trainer.max_epochs=1"], run=False)
    cli.model.trainer = cli.trainer  # the module itself refuses too (used from Python without the CLI)
    cli.trainer.fit_loop.epoch_loop.max_steps = -1
    with pytest.raises(ValueError, match="trainer.max_steps or model.decay_steps"):
        cli.model.configure_optimizers()
