"""FusionModel invariants: shape, count, gradient reach, batch independence, packing, KV cache, masks."""

import dataclasses

import pytest
import torch

from fusion_model.config import PRESETS, FusionConfig, chameleon_ffn_dim
from fusion_model.layers.attention_backends import positions_from_documents
from fusion_model.model import FusionModel


def tiny(**overrides) -> FusionConfig:
    return FusionConfig.from_preset("tiny", image_offset=100, image_codes=64, **overrides)


def model_for(config: FusionConfig) -> FusionModel:
    model = FusionModel(config)
    with torch.no_grad():  # non-trivial norm parameters so their gradients and mapping are exercised
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def test_ffn_rule_matches_chameleon():
    assert chameleon_ffn_dim(4096) == 11008
    assert chameleon_ffn_dim(8192) == 22016


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_closed_form_count_equals_module_count(name):
    config = FusionConfig.from_preset(name)
    with torch.device("meta"):
        model = FusionModel(config)
    assert model.num_parameters() == config.num_parameters()


def test_demo_preset_matches_the_cpu_prototypes_size():
    config = FusionConfig.from_preset("demo")
    assert (config.dim, config.n_layers, config.n_heads) == (128, 4, 4)
    assert 0.8e6 < config.num_parameters(embeddings=False) < 0.95e6


def test_flops_per_token_is_six_n_plus_attention():
    config = tiny()
    matmul = config.num_parameters(embeddings=False) + config.vocab_size * config.dim
    assert config.flops_per_token(64) == 6 * matmul + 12 * config.n_layers * config.dim * 64


def test_config_rejects_bad_values_with_names():
    with pytest.raises(ValueError, match="norm_placement"):
        FusionConfig.from_preset("tiny", norm_placement="post")
    with pytest.raises(ValueError, match="n_kv_heads"):
        FusionConfig.from_preset("tiny", n_kv_heads=3)
    with pytest.raises(ValueError, match="image_bidirectional"):
        FusionConfig.from_preset("tiny", image_bidirectional=True)
    with pytest.raises(ValueError, match="unknown preset"):
        FusionConfig.from_preset("huge")
    with pytest.raises(ValueError, match="unknown fields"):
        FusionConfig.from_dict({**tiny().to_dict(), "bogus": 1})
    assert FusionConfig.from_dict(tiny().to_dict()) == tiny()


@pytest.mark.parametrize(
    ("field", "value"),
    [("dim", 0), ("vocab_size", -5), ("n_layers", 0), ("n_heads", 0), ("max_seq_len", -1), ("n_kv_heads", 0),
     ("ffn_dim", 0), ("dim", 64.0), ("n_layers", True), ("norm_eps", 0.0), ("rope_theta", -1.0),
     ("rope_theta", float("nan")), ("init_std", 0), ("dropout", 1.0), ("dropout", -0.1), ("z_loss_coef", -1e-5),
     ("qk_norm", "yes"), ("image_codes", 0)],
)
def test_config_validates_every_field_up_front_naming_it(field, value):
    overrides = {field: value}
    if field == "image_codes":
        overrides["image_offset"] = 0
    with pytest.raises(ValueError, match=rf"FusionConfig: {field}=.*invalid.*--model\.config\.{field}"):
        FusionConfig.from_preset("tiny", **overrides)


def test_config_accepts_edge_values():
    config = FusionConfig.from_preset("tiny", dropout=0.0, z_loss_coef=0, rope_theta=500000, image_offset=0, image_codes=8)
    assert config.rope_theta == 500000 and config.image_offset == 0


def test_from_dict_starts_from_a_named_preset_and_overrides_its_fields():
    written = {"preset": "small", "dropout": 0.1, "vocab_size": 65536}
    config = FusionConfig.from_dict(written)
    assert config == FusionConfig.from_preset("small", dropout=0.1, vocab_size=65536)
    assert written == {"preset": "small", "dropout": 0.1, "vocab_size": 65536}  # the caller's dict is left alone
    assert "preset" not in config.to_dict() and FusionConfig.from_dict(config.to_dict()) == config  # fully resolved
    assert FusionConfig.from_dict({"dim": 128, "n_heads": 4}).n_layers == FusionConfig().n_layers  # no preset: defaults
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        FusionConfig.from_dict({"preset": "huge"})
    with pytest.raises(ValueError, match=r"unknown fields \['bogus'\]"):
        FusionConfig.from_dict({"preset": "tiny", "bogus": 1})


@pytest.mark.parametrize("placement", ["pre", "swin"])
def test_shapes_and_fp32_logits(placement):
    model = FusionModel(tiny(norm_placement=placement))
    ids = torch.randint(0, 256, (3, 10))
    logits = model(ids)
    assert logits.shape == (3, 10, 256) and logits.dtype == torch.float32
    assert model.forward_hidden(ids).shape == (3, 10, 64)


def test_out_of_vocabulary_id_is_a_clear_error():
    model = FusionModel(tiny())
    with pytest.raises(ValueError, match="vocab_size"):
        model(torch.tensor([[1, 256]]))


@pytest.mark.parametrize("placement", ["pre", "swin"])
def test_one_backward_reaches_every_parameter(placement):
    model = model_for(tiny(norm_placement=placement))
    ids = torch.randint(0, 256, (2, 12))
    docs = torch.tensor([[0] * 5 + [1] * 7, [0] * 12])
    model.loss(ids, docs)["loss"].backward()
    dead = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert dead == []


def test_gradient_checkpointing_gives_the_same_gradients():
    model = model_for(tiny())
    ids = torch.randint(0, 256, (2, 12))
    grads = []
    for flag in (False, True):
        model.config = dataclasses.replace(model.config, gradient_checkpointing=flag)
        model.zero_grad()
        model.loss(ids)["loss"].backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)


def test_hand_written_rope_swiglu_and_rms_norm_backwards_pass_gradcheck():
    """RoPE, SwiGLU and RMSNorm have custom backwards (speed); gradcheck compares them with finite differences, on
    the strided views the model feeds them, and the forwards with the textbook formulas."""
    from fusion_model.layers.mlp import _SwiGLU
    from fusion_model.layers.norms import _RMSNorm
    from fusion_model.layers.rope import apply_rope, rope_cos_sin

    torch.manual_seed(0)
    cos, sin = rope_cos_sin(torch.tensor([[0, 3, 1, 7, 2]]), 6, 10000.0, torch.float64)
    x = torch.randn(1, 5, 2, 6, dtype=torch.float64).transpose(1, 2).requires_grad_()  # (B, H, T, hd) view
    rotate_half = torch.cat((-x[..., 3:], x[..., :3]), dim=-1)
    torch.testing.assert_close(apply_rope(x, cos, sin), x * cos + rotate_half * sin)
    assert torch.autograd.gradcheck(lambda t: apply_rope(t, cos, sin), (x,))
    gate_up = torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(_SwiGLU.apply(gate_up), torch.nn.functional.silu(gate) * up)
    assert torch.autograd.gradcheck(_SwiGLU.apply, (gate_up,))
    # RMSNorm (fp32 path; gradcheck in float64 runs the same formulas)
    x = torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True)
    weight = (1 + 0.1 * torch.randn(8, dtype=torch.float64)).requires_grad_()
    torch.testing.assert_close(_RMSNorm.apply(x, weight, 1e-5), x * (x.pow(2).mean(-1, keepdim=True) + 1e-5).rsqrt() * weight)
    assert torch.autograd.gradcheck(lambda a, b: _RMSNorm.apply(a, b, 1e-5), (x, weight))


def test_compiled_blocks_give_the_same_loss_and_gradients_on_cpu():
    """`compile: true` (torch.compile per block, as the trainer and bench do) computes the same function,
    on whole-document rows (the is_causal kernel) and on packed rows (a mask)."""
    eager = model_for(tiny(norm_placement="swin"))
    compiled = model_for(tiny(norm_placement="swin"))
    compiled.load_state_dict(eager.state_dict())
    for block in compiled.layers:
        block.compile()
    ids = torch.randint(0, 256, (2, 24))
    packed = torch.cat([torch.zeros(2, 10, dtype=torch.long), torch.ones(2, 14, dtype=torch.long)], dim=1)
    for documents in (None, packed):
        losses, grads = [], []
        for model in (eager, compiled):
            model.zero_grad()
            loss = model.loss(ids, documents)["loss"]
            loss.backward()
            losses.append(loss.detach())
            grads.append({n: p.grad for n, p in model.named_parameters()})
        torch.testing.assert_close(losses[1], losses[0])
        for name, grad in grads[0].items():
            torch.testing.assert_close(grads[1][name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_batch_independence_in_eval():
    model = model_for(tiny(dropout=0.1)).eval()
    ids = torch.randint(0, 256, (4, 16))
    docs = torch.tensor([[0] * 16, [0] * 8 + [1] * 8, [-1] * 4 + [0] * 12, [0] * 16])
    with torch.no_grad():
        together = model(ids, document_ids=docs)
        alone = torch.cat([model(ids[i : i + 1], document_ids=docs[i : i + 1]) for i in range(4)])
    torch.testing.assert_close(together, alone)


def test_packed_row_equals_each_document_alone():
    model = model_for(tiny()).eval()
    a, b = torch.randint(0, 256, (1, 7)), torch.randint(0, 256, (1, 9))
    packed = torch.cat([a, b], dim=1)
    docs = torch.tensor([[0] * 7 + [1] * 9])
    with torch.no_grad():
        logits = model(packed, document_ids=docs)
        torch.testing.assert_close(logits[:, :7], model(a))
        torch.testing.assert_close(logits[:, 7:], model(b))


def test_positions_restart_per_document_and_padding_is_finite():
    docs = torch.tensor([[-1, -1, 0, 0, 0, 1, 1, -1]])
    assert positions_from_documents(docs).tolist() == [[0, 1, 0, 1, 2, 0, 1, 0]]
    model = model_for(tiny()).eval()
    with torch.no_grad():
        logits = model(torch.randint(0, 256, (1, 8)), document_ids=docs)
    assert torch.isfinite(logits).all()


def test_kv_cache_incremental_equals_full_forward_with_left_padding():
    model = model_for(tiny()).eval()
    ids = torch.randint(0, 256, (2, 14))
    docs = torch.tensor([[-1, -1, -1] + [0] * 11, [0] * 6 + [1] * 8])
    positions = positions_from_documents(docs)
    with torch.no_grad():
        full = model(ids, positions, docs)
        cache = model.new_kv_cache(batch_size=2, max_len=16)
        steps = [model(ids[:, :5], positions[:, :5], docs[:, :5], kv_cache=cache)]
        for t in range(5, 14):  # positions left implicit: the cache continues each document's count
            steps.append(model(ids[:, t : t + 1], document_ids=docs[:, t : t + 1], kv_cache=cache))
    assert cache.length == 14
    torch.testing.assert_close(torch.cat(steps, dim=1)[docs >= 0], full[docs >= 0])


def test_greedy_decoding_with_cache_equals_without():
    model = model_for(tiny()).eval()
    prompt = torch.randint(0, 256, (1, 4))
    with torch.no_grad():
        plain = prompt
        for _ in range(8):
            plain = torch.cat([plain, model(plain)[:, -1:].argmax(-1)], dim=1)
        cache = model.new_kv_cache(1, 16)
        cached, logits = prompt, model(prompt, kv_cache=cache)
        for _ in range(8):
            token = logits[:, -1:].argmax(-1)
            cached = torch.cat([cached, token], dim=1)
            logits = model(token, kv_cache=cache)
    assert cached.tolist() == plain.tolist()


def test_kv_cache_overflow_is_a_clear_error():
    model = FusionModel(tiny())
    cache = model.new_kv_cache(1, 4)
    with pytest.raises(ValueError, match="max_len"):
        model(torch.randint(0, 256, (1, 5)), kv_cache=cache)


def test_image_bidirectional_lets_an_image_see_its_own_later_codes_only():
    config = tiny(image_bidirectional=True)
    model = model_for(config).eval()
    ids = torch.tensor([[1, 2, 100, 101, 102, 103, 3, 4]])  # text, 4 image codes, text
    changed = ids.clone()
    changed[0, 5] = 120  # the last image code
    with torch.no_grad():
        before, after = model(ids), model(changed)
    assert not torch.allclose(before[0, 2], after[0, 2])  # earlier code of the same image sees it
    torch.testing.assert_close(before[0, :2], after[0, :2])  # text before the image does not
    causal = FusionModel(dataclasses.replace(config, image_bidirectional=False))
    causal.load_state_dict(model.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(causal.eval()(ids)[0, :5], causal(changed)[0, :5])


def test_rms_norm_computes_in_fp32_for_bf16_inputs():
    from fusion_model.layers.norms import RMSNorm

    norm = RMSNorm(64, 1e-5)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(3, 64).bfloat16()
    x32 = x.float()
    expected = norm.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).bfloat16()
    torch.testing.assert_close(norm.to(torch.float32)(x), expected)
    torch.testing.assert_close(norm(x32), expected.float(), atol=0.02, rtol=0.02)


def test_bf16_model_gives_finite_fp32_logits_close_to_fp32():
    model = model_for(tiny()).eval()
    ids = torch.randint(0, 256, (2, 8))
    with torch.no_grad():
        expected = model(ids)
        got = model.to(torch.bfloat16)(ids)
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    torch.testing.assert_close(got, expected, atol=0.1, rtol=0.1)
