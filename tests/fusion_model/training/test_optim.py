"""Chameleon's optimiser recipe: weight decay on matrices only, warmup then exponential / cosine decay."""

import math

import pytest
import torch

from fusion_model.config import FusionConfig
from fusion_model.model import FusionModel
from fusion_model.training.optim import WarmupDecay, build_adamw, build_scheduler, param_groups


def test_weight_decay_only_on_projection_and_embedding_matrices():
    model = FusionModel(FusionConfig.from_preset("tiny"))
    decay, no_decay = param_groups(model, weight_decay=0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    kept = {names[id(p)] for p in no_decay["params"]}
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert decayed | kept == set(names.values()) and not decayed & kept
    assert {"embed.weight", "head.weight", "layers.0.attn.qkv.weight", "layers.1.mlp.down.weight"} <= decayed
    # RMSNorm gains and QK-norm's (n_heads, head_dim) weight and bias are gains, not matrices to shrink
    assert {"norm.weight", "layers.0.attn_norm.weight", "layers.0.attn.q_norm.weight", "layers.0.attn.k_norm.bias"} <= kept
    assert all("norm" in n for n in kept)


def test_adamw_defaults_are_the_papers():
    optimizer = build_adamw(FusionModel(FusionConfig.from_preset("tiny")), lr=1e-4)
    group = optimizer.param_groups[0]
    assert group["betas"] == (0.9, 0.95) and group["eps"] == 1e-5 and group["weight_decay"] == 0.1


def test_warmup_is_linear_then_exponential_decay_reaches_min_ratio_at_horizon():
    schedule = WarmupDecay(warmup_steps=10, decay_steps=110, schedule="exponential", min_ratio=0.01)
    assert [schedule(s) for s in (0, 4, 9)] == pytest.approx([0.1, 0.5, 1.0])
    assert schedule(10) == pytest.approx(1.0)
    assert schedule(60) == pytest.approx(0.1)  # halfway in log space
    assert schedule(110) == pytest.approx(0.01)
    ratios = [schedule(s + 1) / schedule(s) for s in range(10, 109)]
    assert max(ratios) == pytest.approx(min(ratios))  # a constant factor per step: exponential


def test_cosine_decays_to_min_ratio_and_stays_there():
    schedule = WarmupDecay(warmup_steps=5, decay_steps=105, schedule="cosine", min_ratio=0.1)
    assert schedule(55) == pytest.approx(0.1 + 0.9 * 0.5)
    assert schedule(105) == pytest.approx(0.1) and schedule(500) == pytest.approx(0.1)
    assert schedule(30) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.25)))


def test_scheduler_drives_the_optimizer_lr_and_its_state_is_plain_numbers():
    model = torch.nn.Linear(4, 4)
    optimizer = build_adamw(model, lr=1.0)
    scheduler = build_scheduler(optimizer, WarmupDecay(4, 20))
    lrs = []
    for _ in range(6):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert lrs == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0, 0.01 ** (1 / 16)])
    state = scheduler.state_dict()
    assert state["lr_lambdas"][0] == {"warmup_steps": 4, "decay_steps": 20, "schedule": "exponential", "min_ratio": 0.01}


@pytest.mark.parametrize("bad", [dict(schedule="linear"), dict(decay_steps=5), dict(min_ratio=0.0)])
def test_bad_schedule_settings_say_what_to_change(bad):
    with pytest.raises(ValueError, match="choose|must exceed|min_lr_ratio"):
        WarmupDecay(**{"warmup_steps": 10, "decay_steps": 100, **bad})
