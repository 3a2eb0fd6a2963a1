"""LoRA fine-tuning (`fit --model.peft`): the start is the base, only the adapter trains, merging changes nothing,
the checkpoint holds the adapter and its base's fingerprint, and resume, generate, export and DDP work with it."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from fusion_model import cli
from fusion_model.checkpoint import load_model, save_model
from fusion_model.config import FusionConfig
from fusion_model.families import adapters
from fusion_model.families.loading import load_family
from fusion_model.layers import roles
from fusion_model.model import FusionModel
from fusion_model.training.monitors import parameter_groups
from fusion_model.training.optim import param_groups

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fit_worker as fw  # noqa: E402
from test_resume import resume_after_sigkill_matches_an_uninterrupted_run  # noqa: E402

pytest.importorskip("peft")
LORA = "--model.peft={rank: 4, alpha: 8, dropout: 0.0, targets: all}"
IMAGE = {"image_offset": 128, "image_codes": 128}


def tiny(**overrides) -> FusionModel:
    """The tests' tiny decoder, seeded."""
    torch.manual_seed(0)
    return FusionModel(FusionConfig(**{**fw.TINY, **overrides}))


def ids() -> torch.Tensor:
    return torch.randint(1, fw.TINY["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("block", ["dense", "mot"])
def test_lora_starts_as_the_base_and_only_the_adapter_gets_gradients(block):
    extra = {"block": "mot", **IMAGE} if block == "mot" else {}
    model = tiny(**extra)
    with torch.no_grad():
        base = model(ids())
    names = adapters.inject_lora(model, adapters.LoraOptions(rank=4, targets="all"))
    per_layer = 4 * (2 if block == "mot" else 1)  # qkv, out, gate_up, down; each modality's copy under MoT
    assert len(names) == fw.TINY["n_layers"] * per_layer and not any("head" in n for n in names)
    assert torch.equal(model(ids()), base)  # B = 0: exactly the base's logits
    model(ids()).logsumexp(-1).mean().backward()
    for name, param in model.named_parameters():
        if ".lora_" in name:
            assert param.requires_grad and param.grad is not None, name
        else:
            assert not param.requires_grad and param.grad is None, name
    # roles see through the wrapper: the base keeps its role, A and B are the adapter's (decayed, as matrices)
    found = {name: role for name, _, role in roles.parameter_roles(model)}
    qkv = "layers.0.attn.qkv.text.base_layer.weight" if block == "mot" else "layers.0.attn.qkv.base_layer.weight"
    assert found[qkv] == roles.ATTENTION and found["head.weight"] == roles.OUTPUT_HEAD
    assert {found[n] for n in found if ".lora_" in n} == {roles.ADAPTER}
    decayed, undecayed = param_groups(model, 0.1)
    assert len(decayed["params"]) == 2 * len(names) and undecayed["params"] == []
    assert set(parameter_groups(model).values()) >= {"adapter", "attention", "output_head"}


def test_attention_and_mlp_targets_choose_their_projections_by_role():
    model = tiny()
    attention = adapters.lora_targets(model, "attention")
    mlp = adapters.lora_targets(model, "mlp")
    assert attention == ["layers.0.attn.qkv", "layers.0.attn.out", "layers.1.attn.qkv", "layers.1.attn.out"]
    assert mlp == ["layers.0.mlp.gate_up", "layers.0.mlp.down", "layers.1.mlp.gate_up", "layers.1.mlp.down"]
    with pytest.raises(ValueError, match="targets='heads' is invalid"):
        adapters.LoraOptions.from_dict({"targets": "heads"})
    with pytest.raises(ValueError, match=r"no option \['r'\]"):
        adapters.LoraOptions.from_dict({"r": 4})


def test_merged_logits_equal_the_unmerged_adapter():
    model = tiny()
    adapters.inject_lora(model, adapters.LoraOptions(rank=4, alpha=8, targets="all"))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)  # a trained adapter
        unmerged = model(ids())
    merged = adapters.merge_lora(model)
    assert not any(".lora_" in name or "base_layer" in name for name in merged.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(merged(ids()), unmerged)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A 3-step LoRA run on a saved base: (root, base path, the run's recording, its last checkpoint)."""
    root = tmp_path_factory.mktemp("lora")
    tokens = fw.make_token_dir(root / "tokens")
    base = save_model(tiny(), root / "base.ckpt")
    monitor = {"class_path": "fusion_model.training.monitors.StabilityMonitor", "init_args": {"every_n_steps": 1}}
    args = fw.tiny_args(tokens, root / "run", 3, extra=[f"--model.init_weights={base}", LORA,
                                                          fw.recorder_arg(root / "rec"),
                                                          f"--trainer.callbacks+={json.dumps(monitor)}"])
    assert cli.main(["fit", *args]) == 0
    return root, base, torch.load(root / "rec.rank0.pt", weights_only=True), root / "run" / "ckpt" / "last.ckpt"


def test_the_checkpoint_holds_the_adapter_and_the_base_fingerprint_not_the_base(lora_run, capsys):
    root, base, recording, last = lora_run
    checkpoint = torch.load(last, weights_only=True)
    assert set(checkpoint["state_dict"]) == {f"model.{n}" for n in recording["weights"] if ".lora_" in n}
    base_weights = torch.load(base, weights_only=True)["state_dict"]
    assert checkpoint["adapter"] == {"base": str(base.resolve()),
                                     "fingerprint": adapters.weights_fingerprint(tiny().state_dict())}
    size = sum(v.numel() for v in checkpoint["state_dict"].values())
    assert size < 0.1 * sum(v.numel() for v in base_weights.values())
    # trained: the adapter moved, the base did not
    start = tiny().state_dict()
    for name, value in recording["weights"].items():
        if ".lora_" not in name:
            assert torch.equal(value, start[name.replace("base_layer.", "")]), name
    assert any(not torch.equal(v, torch.zeros_like(v)) for n, v in recording["weights"].items() if "lora_B" in n)
    with pytest.raises(ValueError, match="is a LoRA adapter checkpoint"):
        load_model(last)  # the decoder alone cannot come from it (e.g. as another run's init_weights)


def test_the_stability_monitor_sees_the_adapter_as_its_own_group(lora_run):
    root = lora_run[0]
    header = (next((root / "run").rglob("metrics.csv"))).read_text().splitlines()[0].split(",")
    assert {"stability/grad_norm/adapter", "stability/update_ratio/adapter", "stability/block_rms/layer_1"} <= set(header)
    assert "stability/grad_norm/attention" not in header  # the frozen base has no gradient


def test_generate_loads_base_and_adapter_merged_and_refuses_another_base(lora_run, tmp_path, capsys):
    root, base, recording, last = lora_run
    trained = tiny()
    adapters.inject_lora(trained, adapters.LoraOptions(rank=4, alpha=8, targets="all"))
    trained.load_state_dict(recording["weights"])
    loaded = load_family(last).parts["model"]
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids()), trained(ids()))

    other = save_model(_other_weights(), tmp_path / "other.ckpt")
    with pytest.raises(ValueError, match="holds other weights"):
        load_family(last, base=other)
    assert cli.main(["generate", "--checkpoint", str(last), "--base", str(other), "--prompt", "x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "give the base it was trained on" in err[0]
    moved = tmp_path / "moved.ckpt"
    shutil.copy(last, moved)
    checkpoint = torch.load(moved, weights_only=True)
    checkpoint["adapter"]["base"] = str(tmp_path / "gone.ckpt")
    torch.save(checkpoint, moved)
    assert cli.main(["generate", "--checkpoint", str(moved), "--prompt", "x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "gone.ckpt is missing" in err[0] and "needs its base" in err[0]
    assert load_family(moved, base=base).parts["model"] is not None  # --base finds a moved base


def _other_weights() -> FusionModel:
    torch.manual_seed(1)
    return FusionModel(FusionConfig(**fw.TINY))


def test_convert_export_writes_the_merged_weights(lora_run, tmp_path):
    transformers = pytest.importorskip("transformers")
    root, base, recording, last = lora_run
    assert cli.main(["convert", "export", "--checkpoint", str(last), "--out", str(tmp_path / "hf")]) == 0
    exported = transformers.ChameleonForConditionalGeneration.from_pretrained(tmp_path / "hf", local_files_only=True)
    merged = load_family(last).parts["model"]
    with torch.no_grad():
        torch.testing.assert_close(exported.eval()(input_ids=ids()).logits, merged(ids()), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("block", ["dense", "mot"])
def test_a_lora_run_resumes_bit_for_bit(tmp_path, block):
    # mot: a dense base upcycled into the MoT block, each modality's copy adapted; the fingerprint is the upcycled one
    image = IMAGE if block == "mot" else {}
    base = save_model(tiny(**image), tmp_path / "base.ckpt")
    extra = [f"--model.config.{k}={v}" for k, v in {**image, "block": block}.items()]
    resume_after_sigkill_matches_an_uninterrupted_run(
        tmp_path, extra=(*extra, f"--model.init_weights={base}", "--model.peft={rank: 4, alpha: 8, dropout: 0.1}"))


def test_a_lora_resume_without_its_base_is_refused_in_one_line(lora_run, tmp_path, capsys):
    root, base, recording, last = lora_run
    moved = tmp_path / "last.ckpt"
    checkpoint = torch.load(last, weights_only=True)
    checkpoint["adapter"]["base"] = checkpoint["hyper_parameters"]["init_weights"] = str(tmp_path / "gone.ckpt")
    torch.save(checkpoint, moved)
    args = fw.tiny_args(root / "tokens", tmp_path / "run", 4, extra=[f"--ckpt_path={moved}"])
    assert cli.main(["fit", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "gone.ckpt is missing" in err[-1] and "LoRA resume" in err[-1]
    # the base given again (its fingerprint is checked) resumes the run
    assert cli.main(["fit", *args, f"--model.init_weights={base}"]) == 0
    other = save_model(_other_weights(), tmp_path / "other.ckpt")
    assert cli.main(["fit", *args, f"--model.init_weights={other}"]) == 2
    assert "holds other weights" in capsys.readouterr().err.strip().splitlines()[-1]


def test_two_ranks_train_the_adapter_of_one_process(lora_run, tmp_path):
    from test_distributed import _two_nodes

    root, base, single, _ = lora_run
    ranks = _two_nodes(root / "tokens", tmp_path, 3, "ddp", extra=[f"--model.init_weights={base}", LORA])
    for name, value in single["weights"].items():
        torch.testing.assert_close(ranks[0]["weights"][name], value, rtol=0, atol=1e-5, msg=name)


def test_without_peft_installed_the_option_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "peft", None)  # `import peft` raises ImportError
    with pytest.raises(ValueError, match=r'pip install -e "\.\[peft\]"'):
        adapters.inject_lora(tiny(), adapters.LoraOptions())


def test_fsdp2_and_other_families_are_refused_in_one_sentence():
    from fusion_model.training.lightning_module import FusionLightningModule

    module = FusionLightningModule(FusionConfig(**fw.TINY), peft={"rank": 2})
    module._device_mesh = object()  # what ModelParallelStrategy sets before configure_model
    with pytest.raises(ValueError, match="do not run under ModelParallelStrategy"):
        module.configure_model()
    with pytest.raises(ValueError, match="adapts the decoder alone"):
        FusionLightningModule(FusionConfig(**fw.TINY, **IMAGE), family="transfusion", peft={"rank": 2},
                              family_options={"latent_channels": 4, "image_placeholder_id": 6})
