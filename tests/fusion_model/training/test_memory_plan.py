"""The memory plan (fusion_model/training/memory_plan.py): exact counts by hand for the tiny preset, and the plan
against a measured peak of live tensor bytes (bench/bench_memory.py) within 15%."""

import pytest

from fusion_model.config import FusionConfig
from fusion_model.training.memory_plan import GIB, PlanInputs, plan_memory

TINY = FusionConfig.from_preset("tiny", image_offset=16, image_codes=64)  # vocab 256, d 64, 2 layers, 4/2 heads, ffn 128


def _tiny_counts() -> tuple[int, int]:
    """(parameters, parameter tensors) of the tiny preset, counted by hand."""
    d, vocab, hd = 64, 256, 16
    qkv, out = d * (4 + 2 * 2) * hd, 4 * hd * d
    qk_norm = 2 * 4 * hd + 2 * 2 * hd  # weight and bias per head and channel, for q (4 heads) and k (2)
    layer = qkv + out + qk_norm + 2 * d + 3 * d * 128
    # embedding, head, final norm; per layer: two norms, qkv, out, q_norm (w, b), k_norm (w, b), gate_up, down
    return 2 * vocab * d + d + 2 * layer, 3 + 2 * 10


def test_parameters_gradients_and_optimizer_bytes_equal_a_hand_count():
    params, tensors = _tiny_counts()
    assert params == 107_200 == TINY.num_parameters()
    plan = plan_memory(PlanInputs(TINY, micro_batch=2, seq_len=64))
    assert plan.line("parameters") == 4 * params
    assert plan.line("gradients") == 4 * params
    assert plan.line("optimizer states") == 2 * 4 * params + 4 * tensors  # AdamW's two moments and step counters


def test_lora_head_only_and_fsdp2_counts():
    lora = plan_memory(PlanInputs(TINY, peft={"rank": 4, "targets": "attention"}))
    # rank x (in + out) per adapted Linear: qkv (64 -> 128) and out (64 -> 64), two layers
    assert lora.trainable == 2 * 4 * ((64 + 128) + (64 + 64))
    assert lora.line("gradients") == 4 * lora.trainable
    mlp = plan_memory(PlanInputs(TINY, peft={"rank": 4, "targets": "mlp"}))
    assert mlp.trainable == 2 * 4 * ((64 + 256) + (128 + 64))
    head = plan_memory(PlanInputs(TINY, train_only="image_head_rows"))
    assert head.line("gradients") == 4 * 256 * 64  # the whole head, its text rows' gradient zeroed
    sharded = plan_memory(PlanInputs(TINY, world_size=2, strategy="fsdp2"))
    assert sharded.line("parameters") == 4 * 107_200 // 2  # every first dimension here splits evenly in two
    # the optimizer's step counters are whole on every rank
    assert sharded.line("optimizer states") == 2 * sharded.line("parameters") + 4 * 23


def test_the_verdict_and_what_to_change():
    inputs = PlanInputs(FusionConfig.from_preset("small"), micro_batch=8, seq_len=512)
    plan = plan_memory(inputs, device_memory=int(0.25 * GIB))
    assert not plan.fits
    assert "--data.batch_size" in plan.advice and "--model.activation_checkpointing true" in plan.advice
    assert "--plan.force true" in plan.advice
    assert plan_memory(inputs, device_memory=8 * GIB).fits


@pytest.mark.parametrize("case", ["tiny", "tiny, checkpointing"])
def test_the_plan_is_within_15_percent_of_the_measured_peak(case):
    from bench.bench_memory import Case, measure

    measured = measure(Case(case, "tiny", 2, 64, checkpointing="checkpointing" in case))
    for name in ("parameters", "gradients", "optimizer states"):
        assert measured["plan"][name] == measured[name], name
    assert abs(measured["plan"]["total"] / measured["peak"] - 1) <= 0.15
