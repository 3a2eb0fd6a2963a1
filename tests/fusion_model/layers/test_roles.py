"""Parameter roles (fusion_model.layers.roles): the modules declare them; the initialisation, the weight-decay split and the
stability monitor's groups read them, and each gives exactly what the name rules it replaced gave (written out
here as the reference)."""

import pytest
import torch
from torch import nn

from fusion_model.config import FusionConfig
from fusion_model.families.late.model import KINDS, STAGES, LateFusionModel, set_stage
from fusion_model.families.late.qformer_pretraining import QFormerPretrainer
from fusion_model.layers import roles
from fusion_model.layers.norms import QKNorm, RMSNorm
from fusion_model.model import FusionModel
from fusion_model.training.monitors import parameter_groups
from fusion_model.training.optim import param_groups

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: one torch thread, restored after

CONFIGS = {
    "tiny": {},
    "tiny without QK-norm": {"qk_norm": False},
    "tiny, swin norm, 3 layers": {"norm_placement": "swin", "n_layers": 3},
}


# ---- the name rules the roles replaced (as they were before fusion_model.layers.roles) ----------------------------------
def old_decays(name: str, param: nn.Parameter) -> bool:
    """optim.param_groups: matrices, except under a module whose name holds "norm"."""
    is_norm = any("norm" in part for part in name.split(".")[:-1])
    return param.ndim >= 2 and not is_norm


def old_reset_parameters(model: FusionModel) -> None:
    """FusionModel.reset_parameters."""
    std = model.config.init_std
    for name, p in model.named_parameters():
        if p.dim() < 2 or "norm" in name:
            continue
        scale = (2 * model.config.n_layers) ** -0.5 if name.endswith(("out.weight", "down.weight")) else 1.0
        nn.init.normal_(p, mean=0.0, std=std * scale)
    for module in model.modules():
        if isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)
        elif isinstance(module, QKNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)


def old_group(name: str) -> str:
    """monitors.parameter_group."""
    parts = name.split(".")
    if any("norm" in part for part in parts[:-1]):
        return "norms"
    for group, module in (("embeddings", "embed"), ("output_head", "head"), ("attention", "attn"), ("mlp", "mlp")):
        if module in parts[:-1]:
            return group
    return "other"


# ---- helpers -----------------------------------------------------------------------------------------------------
def decay_split(module: nn.Module) -> tuple[set[str], set[str]]:
    """Names in param_groups' decayed and non-decayed groups."""
    decay, no_decay = param_groups(module, weight_decay=0.1)
    names = {id(p): n for n, p in module.named_parameters()}
    return {names[id(p)] for p in decay["params"]}, {names[id(p)] for p in no_decay["params"]}


def old_decay_split(module: nn.Module) -> tuple[set[str], set[str]]:
    trainable = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    return {n for n, p in trainable if old_decays(n, p)}, {n for n, p in trainable if not old_decays(n, p)}


def tiny(**overrides) -> FusionModel:
    return FusionModel(FusionConfig.from_preset("tiny", **overrides))


def late(kind: str) -> LateFusionModel:
    return LateFusionModel(tiny(), kind, image_token_id=6, feature_dim=24, connector_dim=32, num_latents=4,
                           num_queries=4, depth=2, heads=2)


# ---- the decoder -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides", CONFIGS.values(), ids=CONFIGS.keys())
def test_the_decay_split_and_the_monitor_groups_of_the_decoder_are_the_name_rules(overrides):
    model = tiny(**overrides)
    decay, kept = decay_split(model)
    assert (decay, kept) == old_decay_split(model)
    assert decay and kept
    assert parameter_groups(model) == {name: old_group(name) for name, _ in model.named_parameters()}


@pytest.mark.parametrize("overrides", CONFIGS.values(), ids=CONFIGS.keys())
def test_the_initialisation_is_the_name_rules_draw_for_draw(overrides, monkeypatch):
    model = tiny(**overrides)

    def initialised(reset) -> dict[str, torch.Tensor]:
        with torch.no_grad():  # away from any initial value, so that the norms' ones and zeros are checked too
            for p in model.parameters():
                p.uniform_(-3.0, 3.0)
        torch.manual_seed(1)
        reset(model)
        return {name: t.clone() for name, t in model.state_dict().items()}

    ours, reference = initialised(FusionModel.reset_parameters), initialised(old_reset_parameters)
    assert ours.keys() == reference.keys()
    for name in ours:
        assert torch.equal(ours[name], reference[name]), name
    # the constructor initialises with it: the same seed gives the same model as under the name rules
    torch.manual_seed(2)
    built = tiny(**overrides).state_dict()
    monkeypatch.setattr(FusionModel, "reset_parameters", old_reset_parameters)
    torch.manual_seed(2)
    old_built = tiny(**overrides).state_dict()
    assert all(torch.equal(built[name], old_built[name]) for name in built)


def test_every_decoder_parameter_has_a_declared_role():
    model = tiny()
    found = {name: role for name, _, role in roles.parameter_roles(model)}
    assert list(found) == [name for name, _ in model.named_parameters()]
    assert found["embed.weight"] == roles.EMBEDDING and found["head.weight"] == roles.OUTPUT_HEAD
    assert found["layers.0.attn.qkv.weight"] == roles.ATTENTION
    assert found["layers.1.attn.out.weight"] == roles.ATTENTION_OUTPUT
    assert found["layers.0.mlp.gate_up.weight"] == roles.MLP and found["layers.1.mlp.down.weight"] == roles.MLP_OUTPUT
    assert found["layers.0.attn.q_norm.weight"] == found["layers.0.attn_norm.weight"] == found["norm.weight"] == roles.NORM
    assert not {roles.MATRIX, roles.VECTOR} & set(found.values())


def test_roles_follow_the_modules_through_torch_compile():
    model = tiny()
    model.layers[0] = torch.compile(model.layers[0])  # not run: compile only wraps the block (`_orig_mod.` names)
    names = [name for name, _ in model.named_parameters()]
    assert "layers.0._orig_mod.attn.out.weight" in names
    assert decay_split(model) == old_decay_split(model)
    assert parameter_groups(model) == {name: old_group(name) for name in names}


def test_a_declaration_naming_a_missing_parameter_raises():
    class Broken(nn.Module):
        PARAMETER_ROLES = {"proj.weight": roles.ATTENTION}

        def __init__(self) -> None:
            super().__init__()
            self.projection = nn.Linear(2, 2)

    with pytest.raises(ValueError, match="Broken.PARAMETER_ROLES names \\['proj.weight'\\]"):
        roles.parameter_roles(Broken())


# ---- modules that declare nothing: the late-fusion connectors, the Q-Former's stage-1 heads -------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_the_decay_split_of_a_late_fusion_model_is_the_name_rule_in_every_stage(kind):
    wrapped = late(kind)
    assert decay_split(wrapped) == old_decay_split(wrapped)
    # as the Lightning module holds them: the decoder and the connector side by side
    holder = nn.ModuleDict({"model": wrapped.decoder, "connector": wrapped.connector})
    assert decay_split(holder) == old_decay_split(holder)
    for stage in sorted(s for k, s in STAGES if k == kind):
        set_stage(wrapped, stage)
        assert decay_split(wrapped) == old_decay_split(wrapped)
        assert decay_split(holder) == old_decay_split(holder)
    connector = {n for n, _ in wrapped.connector.named_parameters()}
    decay, kept = decay_split(wrapped.connector)
    assert decay and kept and decay | kept == connector  # projections decay; LayerNorms and biases do not


def test_the_decay_split_of_the_qformer_stage_one_heads_is_the_name_rule():
    qformer = late("qformer").connector
    heads = QFormerPretrainer(qformer, vocab_size=256, max_text_len=8)
    assert decay_split(heads) == old_decay_split(heads)
    decay, kept = decay_split(heads)
    assert {"token_embedding.weight", "positions", "start_tokens"} <= decay
    assert {"temperature", "lm_bias", "text_norm.weight"} <= kept
    kinds = {name: role for name, _, role in roles.parameter_roles(heads)}
    assert kinds["text_norm.weight"] == roles.NORM and kinds["qformer.queries"] == roles.MATRIX
    assert kinds["lm_bias"] == roles.VECTOR
