"""The Mixture-of-Transformers block through the sampler: the KV-cached prefill and decode steps equal the uncached
forward over text and image ids, guided and mixed-modality batches give the recomputation's tokens, the compiled
step gives the eager tokens, speculative decoding gives plain greedy's, and the stability monitor sees its
attention."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from fusion_model.layers.rope import apply_rope, rope_cos_sin
from fusion_model.sampling import SamplingConfig, generate_ids
from fusion_model.training.monitors import StabilityMonitor, max_attention_logit
from tokenizer.vocab import train_unified_vocab

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sampling_helpers import CORPUS, greedy, prompts_of, steer, tiny_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: one torch thread, restored after


@pytest.fixture(scope="module")
def vocab():
    return train_unified_vocab(CORPUS, vocab_size=320, image_codes=16, num_specials=16)


@pytest.fixture(scope="module")
def model(vocab):
    """A random tiny MoT decoder, its head pushed towards <boi>, codes and </s> (outputs then mix modalities)."""
    return steer(tiny_model(vocab, block="mot"), vocab, 4.25, torch.Generator().manual_seed(1))


def mixed_prompts(vocab) -> list[list[int]]:
    """The sampler tests' three prompts and one that ends inside an image: its first new tokens are image codes
    while the others' are text, so decode steps hold rows of both modalities."""
    open_image = [*vocab.encode_document(["one two"], eos=False), vocab.boi_id, vocab.image_offset + 3]
    return [*prompts_of(vocab), open_image]


def is_image(vocab, token: int) -> bool:
    return vocab.image_offset <= token < vocab.image_offset + vocab.image_codes


def text_ids(vocab, count: int, generator: torch.Generator) -> list[int]:
    ids = torch.nonzero(vocab.is_text(torch.arange(vocab.vocab_size))).flatten()
    return ids[torch.randint(len(ids), (count,), generator=generator)].tolist()


def code_ids(vocab, count: int, generator: torch.Generator) -> list[int]:
    return (vocab.image_offset + torch.randint(vocab.image_codes, (count,), generator=generator)).tolist()


# ---------------------------------------------------------------- the KV cache


@torch.inference_mode()
def test_cached_prefill_and_decode_steps_equal_the_uncached_forward_over_text_and_image_ids(vocab):
    model = tiny_model(vocab, block="mot")
    generator = torch.Generator().manual_seed(0)
    t, c = (lambda n: text_ids(vocab, n, generator)), (lambda n: code_ids(vocab, n, generator))
    boi, eoi, bos = vocab.boi_id, vocab.eoi_id, vocab.bos_id
    # prefill 8, a chunk of 3, then single tokens; the image of row 0 runs across the prefill's end, row 2's ends at
    # 12: steps 8-12 hold rows of both modalities, steps 13-15 text only
    ids = torch.tensor([
        [bos, *t(2), boi, *c(6), eoi, *t(5)],
        [bos, *t(15)],
        [bos, boi, *c(10), eoi, *t(3)],
    ])
    assert ids.shape == (3, 16)
    full = model(ids)  # no cache: one forward over the whole rows
    cache = model.new_kv_cache(3, 32)
    torch.testing.assert_close(model.head(model.forward_hidden(ids[:, :8], kv_cache=cache)).float(), full[:, :8],
                               rtol=1e-5, atol=1e-5)
    starts = [8, 11, 12, 13, 14, 15]
    for start, end in zip(starts, [*starts[1:], 16]):
        length = end - start
        positions = torch.arange(start, end).expand(3, length)
        got = model.decode_hidden(ids[:, start:end], positions, torch.zeros(3, length, dtype=torch.long),
                                  torch.full((3,), start), cache)
        torch.testing.assert_close(model.head(got).float(), full[:, start:end], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- guidance and mixed-modality batches


CACHED_CASES = {
    "image, two-stream guidance": greedy(mode="image", image_grid=(2, 2), cfg_scale=2.0),
    "image, three-stream guidance": greedy(mode="image", image_grid=(2, 2), cfg_image_scale=1.2, cfg_text_scale=3.0),
    "interleaved, rows in both modalities, two-stream guidance": greedy(
        mode="interleaved", image_grid=(2, 2), max_new_tokens=30, cfg_scale=2.0),
    "interleaved, rows in both modalities": greedy(mode="interleaved", image_grid=(2, 2), max_new_tokens=30),
}


@pytest.mark.parametrize("case", list(CACHED_CASES))
def test_cached_decoding_gives_the_recomputed_tokens_with_guidance_and_mixed_modality_rows(vocab, model, case):
    config = CACHED_CASES[case]
    prompts = mixed_prompts(vocab) if config.mode == "interleaved" else prompts_of(vocab)
    cached = generate_ids(model, vocab, prompts, config)
    assert cached == generate_ids(model, vocab, prompts, replace(config, use_kv_cache=False))
    assert all(len(row) > 0 for row in cached)
    if config.mode == "interleaved":
        # the open image's row drew codes while another row drew text in the same steps
        assert is_image(vocab, cached[-1][0]) and not is_image(vocab, cached[0][0])
        assert any(vocab.boi_id in row for row in cached[:-1])  # and text rows opened images of their own


# ---------------------------------------------------------------- the compiled step


def test_the_compiled_step_gives_the_eager_tokens_and_forwards(vocab, model):
    eager = SamplingConfig(mode="interleaved", seed=3, image_grid=(2, 2), cfg_scale=3.0, image_top_k=5,
                           max_new_tokens=30)
    compiled = replace(eager, compile=True)
    prompts = mixed_prompts(vocab)
    stats_eager, stats_compiled = {}, {}
    expected = generate_ids(model, vocab, prompts, eager, stats=stats_eager)
    assert generate_ids(model, vocab, prompts, compiled, stats=stats_compiled) == expected
    assert stats_compiled == stats_eager
    assert stats_eager["image_tokens"] > 0 and any(len(row) > 3 for row in expected)


# ---------------------------------------------------------------- speculative decoding


@pytest.mark.parametrize("mode, guidance", [("image", {"cfg_scale": 2.0}), ("interleaved", {})])
def test_greedy_speculative_decoding_gives_the_plain_greedy_ids(vocab, mode, guidance):
    model = steer(tiny_model(vocab, context=96, block="mot"), vocab, 4.25, torch.Generator().manual_seed(1))
    config = greedy(mode=mode, image_grid=(4, 4), max_new_tokens=None if mode == "image" else 60, **guidance)
    prompts = prompts_of(vocab)[:2]
    plain_stats: dict = {}
    plain = generate_ids(model, vocab, prompts, config, stats=plain_stats)
    assert plain_stats["image_tokens"] >= 16  # an image was made, so the speculative path ran
    for window in (2, 4):
        stats: dict = {}
        assert generate_ids(model, vocab, prompts, replace(config, speculative_window=window), stats=stats) == plain
        assert stats["image_tokens"] == plain_stats["image_tokens"] and stats["forwards"] <= plain_stats["forwards"]
    recomputed = generate_ids(model, vocab, prompts, replace(config, speculative_window=4, use_kv_cache=False))
    assert recomputed == plain


# ---------------------------------------------------------------- the stability monitor


def test_the_stability_monitor_sees_each_modalitys_queries_and_keys(vocab):
    """The monitor's attention-logit maxima are those of q and k computed by hand with each token's own modality's
    norm, projection and QK-norm; its block norms are the blocks' outputs'."""
    model = tiny_model(vocab, block="mot")
    with torch.no_grad():  # norms away from the identity, so a copy of the wrong modality shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.5 * torch.randn_like(p))
    generator = torch.Generator().manual_seed(0)
    rows = [[vocab.bos_id, *text_ids(vocab, 3, generator), vocab.boi_id, *code_ids(vocab, 8, generator),
             vocab.eoi_id, *text_ids(vocab, 2, generator)], [vocab.bos_id, *text_ids(vocab, 15, generator)]]
    ids = torch.tensor(rows)
    documents = torch.tensor([[0] * 10 + [1] * 6, [0] * 12 + [-1] * 4])
    model.train()
    found = StabilityMonitor().forward_statistics(model, {"input_ids": ids, "document_ids": documents})
    assert model.training and all(block.attn.observer is None for block in model.layers)

    model.eval()
    config = model.config
    heads, kv_heads, head_dim = config.n_heads, config.kv_heads, config.head_dim
    image = ((ids >= vocab.image_offset) & (ids < vocab.image_offset + vocab.image_codes))[..., None, None]
    ctx, positions = model.attention_context(ids, documents, None, None)  # positions restart per document
    cos, sin = rope_cos_sin(positions, head_dim, config.rope_theta, torch.float32)
    x = model.embed(ids)
    real = documents >= 0
    with torch.no_grad():
        for layer, block in enumerate(model.layers):
            per_modality = []
            for name in ("text", "image"):  # every token through both copies; each keeps its own modality's
                attn = block.attn
                qkv = attn.qkv[name](block.attn_norm[name](x)).view(2, 16, heads + 2 * kv_heads, head_dim)
                q, k, _ = qkv.split([heads, kv_heads, kv_heads], dim=2)
                per_modality.append((attn.q_norm[name](q), attn.k_norm[name](k)))
            (q_text, k_text), (q_image, k_image) = per_modality
            q, k = torch.where(image, q_image, q_text), torch.where(image, k_image, k_text)
            q, k = apply_rope(q.transpose(1, 2), cos, sin), apply_rope(k.transpose(1, 2), cos, sin)
            expected = max_attention_logit(q, k, documents)
            torch.testing.assert_close(found[f"stability/attn_logit_max/layer_{layer}"], expected, rtol=1e-5, atol=0)
            x = block(x, cos, sin, ctx)
            torch.testing.assert_close(found[f"stability/block_rms/layer_{layer}"], x[real].pow(2).mean().sqrt(),
                                       rtol=1e-5, atol=0)
