"""The decode path: the model's single-token step and its chunks (speculative decoding) equal a cached forward, and
the compiled decode steps (torch.compile, static shapes, state changed in place), plain and speculative, give the
eager sampler's tokens, forward for forward."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from fusion_model.sampling import SamplingConfig, generate_ids
from tokenizer.vocab import train_unified_vocab

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sampling_helpers import CORPUS, greedy, prompts_of, steer, tiny_model  # noqa: E402


@pytest.fixture(scope="module")
def vocab():
    return train_unified_vocab(CORPUS, vocab_size=320, image_codes=16, num_specials=16)


@pytest.fixture(scope="module")
def model(vocab):
    model = tiny_model(vocab)
    return steer(model, vocab, 4.25, torch.Generator().manual_seed(1))  # interleaved output mixes text and images


@torch.inference_mode()
def test_decode_hidden_equals_a_cached_forward_for_live_and_padding_rows(vocab):
    model = tiny_model(vocab)
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(1, vocab.image_offset, (3, 6), generator=generator)
    docs = torch.zeros_like(prompt)
    docs[2, :2] = -1  # a left-padded prompt
    positions = (torch.arange(6) - torch.tensor([0, 0, 2])[:, None]).clamp_min(0)
    reference, static = model.new_kv_cache(3, 16), model.new_kv_cache(3, 16)
    for cache in (reference, static):
        model.forward_hidden(prompt, position_ids=positions, document_ids=docs, kv_cache=cache)
    next_pos = torch.tensor([6, 6, 4])
    for step in range(4):
        token = torch.randint(1, vocab.image_offset, (3,), generator=generator)
        live = torch.tensor([True, step != 1, True])  # row 1 pads once: its token attends to nothing real
        doc = torch.where(live, 0, -1)
        expected = model.forward_hidden(token[:, None], position_ids=next_pos[:, None], document_ids=doc[:, None],
                                        kv_cache=reference)[:, 0]
        got = model.decode_hidden(token[:, None], next_pos[:, None], doc[:, None], torch.full((3,), 6 + step), static)
        torch.testing.assert_close(got[live, 0], expected[live], rtol=1e-5, atol=1e-5)
        next_pos = next_pos + live.long()
    assert torch.equal(static.document_ids[:, :10], reference.document_ids[:, :10])
    assert torch.equal(static.positions[:, :10], reference.positions[:, :10])


@torch.inference_mode()
def test_rows_that_keep_different_prefixes_of_a_chunk_overwrite_the_rest(vocab):
    """Speculative decoding feeds a token and its drafts, and each row keeps its own number of them: the next chunk
    goes after each row's kept ones, and sees exactly what a forward over the kept tokens alone would."""
    model = tiny_model(vocab)
    generator = torch.Generator().manual_seed(1)
    prompt = torch.randint(1, vocab.image_offset, (2, 5), generator=generator)
    first = torch.randint(1, vocab.image_offset, (2, 4), generator=generator)
    second = torch.randint(1, vocab.image_offset, (2, 3), generator=generator)
    cache = model.new_kv_cache(2, 16)
    model.forward_hidden(prompt, kv_cache=cache)
    ones = torch.ones(2, 4, dtype=torch.long)
    model.decode_hidden(first, 5 + torch.arange(4).expand(2, -1), 0 * ones, torch.tensor([5, 5]), cache)
    kept = [1, 4]  # row 0 keeps one token of the chunk, row 1 all four
    slot = 5 + torch.tensor(kept)
    got = model.decode_hidden(second, slot[:, None] + torch.arange(3), torch.zeros(2, 3, dtype=torch.long), slot,
                              cache)
    for row, count in enumerate(kept):
        alone = torch.cat([prompt[row], first[row, :count], second[row]])[None]
        torch.testing.assert_close(got[row], model.forward_hidden(alone)[0, -3:], rtol=1e-5, atol=1e-5)


CASES = {
    "greedy interleaved": greedy(mode="interleaved", image_grid=(2, 2), max_new_tokens=30),
    "sampled text, top-p and repetition penalty": SamplingConfig(
        mode="text", seed=2, text_temperature=0.8, text_top_p=0.9, repetition_penalty=1.3, max_new_tokens=20),
    "sampled interleaved, two-stream guidance, top-k": SamplingConfig(
        mode="interleaved", seed=3, image_grid=(2, 2), cfg_scale=3.0, image_top_k=5, max_new_tokens=30),
    "sampled image, three-stream guidance": SamplingConfig.chameleon(mode="image", seed=5, image_grid=(2, 2)),
    # speculative Jacobi decoding: its step compiles too, and alternates with the plain one outside images
    "greedy interleaved, speculative window 3": greedy(
        mode="interleaved", image_grid=(2, 2), max_new_tokens=30, speculative_window=3),
    "sampled image, three-stream guidance, speculative window 3": SamplingConfig.chameleon(
        mode="image", seed=5, image_grid=(2, 2), speculative_window=3),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_compiled_step_gives_the_eager_tokens_and_forwards(vocab, model, case):
    eager = CASES[case]
    compiled = SamplingConfig(**{**eager.__dict__, "compile": True})
    prompts = prompts_of(vocab)
    stats_eager, stats_compiled = {}, {}
    expected = generate_ids(model, vocab, prompts, eager, stats=stats_eager)
    assert generate_ids(model, vocab, prompts, compiled, stats=stats_compiled) == expected
    assert stats_compiled == stats_eager
    assert any(len(row) > 3 for row in expected)  # the check covered real decoding, not an immediate stop
    if eager.speculative_window:
        assert stats_eager["image_tokens"] > 0  # the speculative step ran


def test_the_compiled_step_is_reused_by_prompts_of_other_lengths(vocab, model):
    config = SamplingConfig(mode="interleaved", seed=7, image_grid=(2, 2), cfg_scale=2.0, max_new_tokens=24,
                            compile=True)
    generate_ids(model, vocab, prompts_of(vocab), config)  # compiles (or reuses an earlier test's graph)
    graphs = dict(torch._dynamo.utils.counters["stats"])
    others = [vocab.encode_document(["one two three four five"], eos=False), [vocab.bos_id],
              vocab.encode_document(["the"], eos=False)]
    got = generate_ids(model, vocab, others, config)
    assert dict(torch._dynamo.utils.counters["stats"]) == graphs, "prompts of other lengths compiled again"
    assert got == generate_ids(model, vocab, others, SamplingConfig(**{**config.__dict__, "compile": False}))
