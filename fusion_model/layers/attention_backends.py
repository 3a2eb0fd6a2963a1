"""Packed-sequence attention: document/causal masks and the SDPA, flex-attention and xformers backends."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from tokenizer.layout import image_position_mask


def positions_from_documents(
    document_ids: torch.Tensor, start: torch.Tensor | None = None, start_document: torch.Tensor | None = None
) -> torch.Tensor:
    """Position of each token inside its document (restarts at 0 where the document id changes).

    Documents are contiguous runs of one id along a row. `start`/`start_document` (B,) continue a run
    from a KV cache: tokens of the first run continue at `start` when their id equals `start_document`.
    """
    batch, length = document_ids.shape
    index = torch.arange(length, device=document_ids.device).expand(batch, length)
    boundary = torch.ones_like(document_ids, dtype=torch.bool)
    boundary[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    run_start = torch.where(boundary, index, torch.zeros_like(index)).cummax(dim=1).values
    positions = index - run_start
    if start is not None:
        continues = (run_start == 0) & (document_ids == start_document[:, None])
        positions = positions + torch.where(continues, start[:, None], torch.zeros_like(positions))
    return positions.clamp_min(0)


def image_runs(input_ids: torch.Tensor, image_offset: int | None, image_codes: int | None,
               placeholder_id: int | None = None) -> torch.Tensor:
    """Id of the contiguous run of image tokens each token belongs to (-1 for non-image tokens); image tokens are
    image codes and, when given, the continuous-image placeholder id (`tokenizer.layout.image_position_mask`)."""
    is_image = image_position_mask(input_ids, image_offset, image_codes, placeholder_id)
    starts = is_image.clone()
    starts[:, 1:] &= ~is_image[:, :-1]
    return torch.where(is_image, starts.long().cumsum(dim=1), torch.full_like(input_ids, -1))


def build_mask(
    doc_q: torch.Tensor,
    doc_k: torch.Tensor,
    q_index: torch.Tensor,
    k_index: torch.Tensor,
    run_q: torch.Tensor | None = None,
    run_k: torch.Tensor | None = None,
    visible_from: torch.Tensor | None = None,
) -> torch.Tensor:
    """Boolean mask (B, 1, Tq, Tk), True = may attend: same document and causal.

    q_index is (Tq,), or (B, Tq) when each row's queries sit at their own cache indices (the decode path).

    A padding query (document -1) attends to itself only, so its softmax never sees an empty row (NaN).
    With image runs given, tokens of one image run of one document also see each other (bidirectional).
    With visible_from (B, Tq) given, each query sees no key before that key index (e.g. an image trained without
    its caption sees only itself; every query must still see one key, such as itself).
    """
    same_doc = doc_q[:, :, None] == doc_k[:, None, :]
    q_index = q_index if q_index.dim() == 2 else q_index[None]
    allowed = same_doc & (k_index[None, None, :] <= q_index[:, :, None])
    if run_q is not None:
        allowed |= same_doc & (run_q[:, :, None] == run_k[:, None, :]) & (run_q[:, :, None] >= 0)
    if visible_from is not None:
        allowed &= k_index[None, None, :] >= visible_from[:, :, None]
    padding = doc_q[:, :, None] < 0
    itself = k_index[None, None, :] == q_index[:, :, None]
    allowed = torch.where(padding, itself, allowed & (doc_q[:, :, None] >= 0))
    return allowed[:, None]


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                   dropout_p: float = 0.0) -> torch.Tensor:
    """Scaled dot-product attention on (B, H, T, hd) tensors; mask None means plain causal."""
    gqa = q.shape[1] != k.shape[1]
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, enable_gqa=gqa)


@functools.cache
def _flex():
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    # compiled once per process; eager flex attention materialises the scores and is only for checks
    compiled = torch.compile(flex_attention, dynamic=False) if torch.cuda.is_available() else flex_attention
    return create_block_mask, compiled


def flex_block_mask(doc_q: torch.Tensor, doc_k: torch.Tensor, q_offset: int = 0,
                    run_q: torch.Tensor | None = None, run_k: torch.Tensor | None = None,
                    visible_from: torch.Tensor | None = None):
    """A flex-attention BlockMask with the same rule as build_mask (query i sits at key index q_offset + i)."""
    create_block_mask, _ = _flex()

    def mask_mod(b, h, qi, ki):
        dq, dk = doc_q[b, qi], doc_k[b, ki]
        qpos = qi + q_offset
        allowed = (dq == dk) & (ki <= qpos)
        if run_q is not None:
            rq = run_q[b, qi]
            allowed = allowed | ((dq == dk) & (rq == run_k[b, ki]) & (rq >= 0))
        if visible_from is not None:
            allowed = allowed & (ki >= visible_from[b, qi])
        return torch.where(dq < 0, ki == qpos, allowed)

    batch, tq = doc_q.shape
    # compiled mask construction on CUDA avoids materialising the dense (B, Tq, Tk) mask there
    return create_block_mask(mask_mod, batch, None, tq, doc_k.shape[1], device=doc_q.device,
                             _compile=doc_q.device.type == "cuda")


def flex_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask) -> torch.Tensor:
    """flex_attention on (B, H, T, hd) tensors with a BlockMask from flex_block_mask."""
    _, attend = _flex()
    return attend(q, k, v, block_mask=block_mask, enable_gqa=q.shape[1] != k.shape[1])


def xformers_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, document_ids: torch.Tensor) -> torch.Tensor:
    """xformers memory-efficient attention with a block-diagonal causal mask over the packed documents.

    The batch is flattened into one long sequence; every document (and every padding token, as a
    length-1 block) becomes one causal block. Needs xformers on CUDA; no KV cache, no image runs.
    """
    try:
        from xformers.ops import fmha
    except ImportError as error:
        raise ImportError(
            "attention_backend='xformers' needs the optional xformers package (CUDA only): "
            "pip install 'early-fusion[gpu]', or choose attention_backend='sdpa' or 'flex'"
        ) from error
    batch, heads, length, head_dim = q.shape
    seqlens = _block_lengths(document_ids)
    bias = fmha.attn_bias.BlockDiagonalCausalMask.from_seqlens(seqlens)
    groups = heads // k.shape[1]

    def flat(x: torch.Tensor, n: int) -> torch.Tensor:
        x = x.transpose(1, 2).reshape(1, batch * length, x.shape[1], head_dim)
        return x.repeat_interleave(n, dim=2) if n > 1 else x

    out = fmha.memory_efficient_attention(flat(q, 1), flat(k, groups), flat(v, groups), attn_bias=bias)
    return out.reshape(batch, length, heads, head_dim).transpose(1, 2)


def _block_lengths(document_ids: torch.Tensor) -> list[int]:
    """Lengths of the causal blocks of a flattened batch: each document run, and 1 per padding token."""
    flat = document_ids.reshape(-1)
    row = torch.arange(document_ids.shape[0], device=flat.device).repeat_interleave(document_ids.shape[1])
    boundary = torch.ones_like(flat, dtype=torch.bool)
    boundary[1:] = (flat[1:] != flat[:-1]) | (row[1:] != row[:-1])
    boundary |= flat < 0
    starts = torch.nonzero(boundary).flatten().tolist() + [flat.numel()]
    return [b - a for a, b in zip(starts[:-1], starts[1:])]
