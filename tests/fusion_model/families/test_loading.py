"""One loader for every family's checkpoint: checkpoints written before families existed (no `family` in their
hparams, late fusion as `late_fusion: {kind, stage}`) load as before, and a checkpoint refuses tokenizers other
than the ones it recorded."""

from __future__ import annotations

import types

import pytest
import torch

from fusion_model.checkpoint import save_model
from fusion_model.config import FusionConfig
from fusion_model.families.loading import load_family
from fusion_model.model import FusionModel
from fusion_model.training.lightning_module import FusionLightningModule

CONFIG = FusionConfig.from_preset("tiny", image_offset=128, image_codes=64)
LATE = {"kind": "llava", "stage": 2, "feature_dim": 8, "image_token_id": 5, "boi_id": 3, "eoi_id": 4}


def old_checkpoint(path, module: FusionLightningModule, **hparams) -> None:
    """A checkpoint as the trainer wrote it before model families: hparams without family/family_options."""
    torch.save({"state_dict": module.state_dict(), "hyper_parameters": {"config": CONFIG.to_dict(), "lr": 1e-4,
                                                                          **hparams}}, path)


def test_a_late_fusion_checkpoint_from_before_families_loads_as_its_family(tmp_path):
    torch.manual_seed(0)
    module = FusionLightningModule(CONFIG, late_fusion=LATE)
    assert module.family.name == "llava" and sorted(module.parts) == ["connector", "model"]
    old_checkpoint(tmp_path / "old.ckpt", module, late_fusion=LATE)
    loaded = load_family(tmp_path / "old.ckpt")
    assert loaded.family.name == "llava" and loaded.family.options.stage == 2
    for name, part in loaded.parts.items():
        for key, value in part.state_dict().items():
            assert torch.equal(value, module.state_dict()[f"{name}.{key}"]), f"{name}.{key}"
    stored = torch.load(tmp_path / "old.ckpt", weights_only=True)["hyper_parameters"]
    assert FusionLightningModule(**stored).family.name == "llava"  # LightningCLI rebuilds the module from them


def test_a_chameleon_checkpoint_without_a_family_and_a_convert_import_file_load_as_chameleon(tmp_path):
    torch.manual_seed(0)
    module = FusionLightningModule(CONFIG)
    old_checkpoint(tmp_path / "old.ckpt", module)
    save_model(module.model, tmp_path / "imported.ckpt")
    for path in (tmp_path / "old.ckpt", tmp_path / "imported.ckpt"):
        loaded = load_family(path)
        assert loaded.family.name == "chameleon" and isinstance(loaded.parts["model"], FusionModel)
        assert torch.equal(loaded.parts["model"].head.weight, module.model.head.weight)


def test_a_blip2_stage_one_checkpoint_loads_its_heads_without_a_second_copy_of_the_qformer(tmp_path):
    options = {**LATE, "kind": "qformer", "stage": 1, "num_queries": 2, "depth": 1}
    module = FusionLightningModule(CONFIG, late_fusion=options)
    assert module.family.name == "blip2-stage1"
    assert not any(key.startswith("stage1_heads.qformer.") for key in module.state_dict())
    torch.save({"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams)}, tmp_path / "s1.ckpt")
    loaded = load_family(tmp_path / "s1.ckpt")
    assert loaded.parts["stage1_heads"].qformer is loaded.parts["connector"]
    with pytest.raises(ValueError, match="cannot caption.*stage 2"):
        loaded.family.generate(loaded.parts, None, None, [["a"]], None)


def test_a_checkpoint_refuses_tokenizers_other_than_the_ones_it_was_trained_with(tmp_path):
    module = FusionLightningModule(CONFIG, tokenizers={"vocab": "v1", "image_tokenizer": "i1"})
    torch.save({"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams)}, tmp_path / "c.ckpt")
    loaded = load_family(tmp_path / "c.ckpt")
    assert loaded.tokenizers == {"vocab": "v1", "image_tokenizer": "i1"}

    def tokenizer(fingerprint: str):
        return types.SimpleNamespace(fingerprint=lambda: fingerprint)

    loaded.check_tokenizers(tokenizer("v1"), tokenizer("i1"), where="c.ckpt")  # the same ones pass
    with pytest.raises(ValueError, match=r"another image tokenizer \(fingerprint i1; --image-tokenizer has i2\)"):
        loaded.check_tokenizers(tokenizer("v1"), tokenizer("i2"), where="c.ckpt")
    with pytest.raises(ValueError, match="another vocab"):
        loaded.check_tokenizers(tokenizer("v2"), None, where="c.ckpt")


def test_convert_export_refuses_a_family_transformers_cannot_hold(tmp_path, capsys):
    from fusion_model.cli import main

    module = FusionLightningModule(CONFIG, family="flamingo", family_options={**LATE, "kind": "flamingo", "stage": 1})
    torch.save({"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams)}, tmp_path / "f.ckpt")
    assert main(["convert", "export", "--checkpoint", str(tmp_path / "f.ckpt"), "--out", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "flamingo checkpoint" in err and "train.py generate" in err
    assert not (tmp_path / "hf").exists()
