"""Attention masks over packed rows, and agreement of the flex / xformers backends with SDPA."""

import importlib.util
import warnings

import pytest
import torch

from fusion_model.config import FusionConfig
from fusion_model.layers import attention_backends as A
from fusion_model.model import FusionModel

DOCS = torch.tensor([[-1, -1, 0, 0, 0, 1, 1, 1, 1, -1], [0, 0, 0, 0, 0, 0, 0, 0, 0, 0]])


def brute_force_mask(docs: torch.Tensor) -> torch.Tensor:
    batch, length = docs.shape
    mask = torch.zeros(batch, 1, length, length, dtype=torch.bool)
    for b in range(batch):
        for q in range(length):
            for k in range(length):
                if docs[b, q] < 0:
                    mask[b, 0, q, k] = q == k
                else:
                    mask[b, 0, q, k] = bool(docs[b, q] == docs[b, k]) and k <= q
    return mask


def test_mask_is_causal_within_documents_and_padding_sees_itself():
    index = torch.arange(DOCS.shape[1])
    assert torch.equal(A.build_mask(DOCS, DOCS, index, index), brute_force_mask(DOCS))


def test_mask_for_cached_queries_is_the_last_rows_of_the_full_mask():
    index = torch.arange(DOCS.shape[1])
    tail = A.build_mask(DOCS[:, 6:], DOCS, index[6:], index)
    assert torch.equal(tail, brute_force_mask(DOCS)[:, :, 6:])


def test_image_runs_number_each_contiguous_image():
    ids = torch.tensor([[1, 100, 101, 2, 102, 103, 103, 3]])
    assert A.image_runs(ids, 100, 10).tolist() == [[-1, 1, 1, -1, 2, 2, 2, -1]]


def test_block_lengths_split_rows_documents_and_padding():
    assert A._block_lengths(DOCS) == [1, 1, 3, 4, 1, 10]


def _qkv(heads=4, kv_heads=2, length=10):
    batch = DOCS.shape[0]
    return (torch.randn(batch, heads, length, 8), torch.randn(batch, kv_heads, length, 8),
            torch.randn(batch, kv_heads, length, 8))


def test_sdpa_with_gqa_equals_repeated_heads():
    q, k, v = _qkv()
    index = torch.arange(10)
    mask = A.build_mask(DOCS, DOCS, index, index)
    grouped = A.sdpa_attention(q, k, v, mask)
    repeated = A.sdpa_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), mask)
    torch.testing.assert_close(grouped, repeated)


def _flex_runs() -> str | None:
    """Why flex attention cannot run here (None when it can)."""
    try:
        from torch.nn.attention.flex_attention import flex_attention  # noqa: F401
    except ImportError as error:
        return f"flex_attention unavailable: {error}"
    return None


@pytest.mark.skipif(_flex_runs() is not None, reason=str(_flex_runs()))
def test_flex_forward_agrees_with_sdpa():
    q, k, v = _qkv()
    index = torch.arange(10)
    expected = A.sdpa_attention(q, k, v, A.build_mask(DOCS, DOCS, index, index))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager flex on CPU warns that it is for debugging only
        got = A.flex_attention(q, k, v, A.flex_block_mask(DOCS, DOCS))
    torch.testing.assert_close(got, expected)


@pytest.mark.skipif(_flex_runs() is not None, reason=str(_flex_runs()))
def test_model_with_flex_backend_agrees_with_sdpa_backend():
    config = FusionConfig.from_preset("tiny", attention_backend="sdpa")
    sdpa_model = FusionModel(config).eval()
    flex_model = FusionModel(FusionConfig.from_preset("tiny", attention_backend="flex")).eval()
    flex_model.load_state_dict(sdpa_model.state_dict())
    ids = torch.randint(0, 256, DOCS.shape)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.testing.assert_close(flex_model(ids, document_ids=DOCS), sdpa_model(ids, document_ids=DOCS))


XFORMERS = importlib.util.find_spec("xformers") is not None


@pytest.mark.skipif(XFORMERS, reason="xformers is installed; the missing-package message cannot be shown")
def test_xformers_backend_without_the_package_is_a_clear_error():
    q, k, v = _qkv()
    with pytest.raises(ImportError, match="xformers"):
        A.xformers_attention(q, k, v, DOCS)


@pytest.mark.skipif(not (XFORMERS and torch.cuda.is_available()), reason="xformers runs on CUDA only")
def test_xformers_agrees_with_sdpa_on_cuda():
    q, k, v = (t.cuda().half() for t in _qkv())
    index = torch.arange(10, device="cuda")
    docs = DOCS.cuda()
    expected = A.sdpa_attention(q, k, v, A.build_mask(docs, docs, index, index))
    got = A.xformers_attention(q, k, v, docs)
    torch.testing.assert_close(got, expected, atol=2e-3, rtol=2e-3)


@pytest.mark.skipif(_flex_runs() is not None, reason=str(_flex_runs()))
def test_flex_bidirectional_image_mask_agrees_with_sdpa():
    ids = torch.tensor([[1, 100, 101, 102, 2, 103, 104, 3, 4, 5], [100, 101, 1, 2, 3, 4, 5, 6, 100, 7]])
    runs = A.image_runs(ids, 100, 10)
    q, k, v = _qkv()
    index = torch.arange(10)
    expected = A.sdpa_attention(q, k, v, A.build_mask(DOCS, DOCS, index, index, runs, runs))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = A.flex_attention(q, k, v, A.flex_block_mask(DOCS, DOCS, 0, runs, runs))
    torch.testing.assert_close(got, expected)


def test_bidirectional_prompt_image_prefilled_in_the_cache_equals_full_forward():
    config = FusionConfig.from_preset("tiny", image_offset=100, image_codes=64, image_bidirectional=True)
    model = FusionModel(config).eval()
    prompt = torch.tensor([[1, 2, 100, 101, 102, 103, 3]])
    with torch.no_grad():
        full = model(prompt)
        cache = model.new_kv_cache(1, 16)
        torch.testing.assert_close(model(prompt, kv_cache=cache), full)
