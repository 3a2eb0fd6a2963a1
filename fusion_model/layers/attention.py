"""Self-attention over packed rows: the context every layer of one forward shares, and the attention layer
(QK-norm before RoPE, the KV cache, the backend of `attention_backends`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from fusion_model.layers import attention_backends as attn_lib
from fusion_model.layers import roles
from fusion_model.layers.kv_cache import KVCache
from fusion_model.layers.norms import QKNorm
from fusion_model.layers.rope import apply_rope


@dataclass
class AttentionContext:
    """Everything attention needs besides q/k/v, built once per forward and shared by all layers."""

    backend: str  # "sdpa" | "flex" | "xformers"
    mask: torch.Tensor | None = None  # boolean (B, 1, Tq, Tk) for sdpa; None = plain causal
    block_mask: object = None  # flex BlockMask
    document_ids: torch.Tensor | None = None  # for xformers
    cache: KVCache | None = None
    slot: torch.Tensor | None = None  # decode_hidden: each row's cache index (B,) where its new tokens start
    # blocks with weights per modality (uses_modality): the flat (B * T) indices of each modality's tokens, text
    # first, then image; found once per forward from the ids (fusion_model.model.modality_groups)
    modality_groups: tuple[torch.Tensor, ...] | None = None

class Attention(nn.Module):
    """Multi-head (optionally grouped-query) self-attention with QK-norm before RoPE; fused QKV projection."""

    PARAMETER_ROLES = {"qkv.weight": roles.ATTENTION, "out.weight": roles.ATTENTION_OUTPUT}

    def __init__(self, dim: int, n_heads: int, kv_heads: int, qk_norm: bool, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.n_heads, self.kv_heads, self.head_dim = n_heads, kv_heads, dim // n_heads
        self.build_projections(dim, qk_norm)
        # a monitor (fusion_model.training.monitors) sets a callable(attention, q, k, ctx) here to see what the
        # scores are made of; None, the default, costs one attribute check and changes nothing
        self.observer = None

    def build_projections(self, dim: int, qk_norm: bool) -> None:
        """The fused QKV and output projections and QK-norm (a block with weights per modality builds its own)."""
        self.qkv = nn.Linear(dim, (self.n_heads + 2 * self.kv_heads) * self.head_dim, bias=False)
        self.out = nn.Linear(self.n_heads * self.head_dim, dim, bias=False)
        self.q_norm = QKNorm(self.n_heads, self.head_dim) if qk_norm else None
        self.k_norm = QKNorm(self.kv_heads, self.head_dim) if qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """x: (B, T, dim) -> (B, T, dim)."""
        batch, length, _ = x.shape
        qkv = self.qkv(x).view(batch, length, self.n_heads + 2 * self.kv_heads, self.head_dim)
        q, k, v = qkv.split([self.n_heads, self.kv_heads, self.kv_heads], dim=2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return self.out(self.attend(q, k, v, cos, sin, ctx))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               ctx: AttentionContext) -> torch.Tensor:
        """Attention from QK-normed q (B, T, heads, head_dim), k and v (B, T, kv_heads, head_dim): RoPE, the KV
        cache, the observer and the backend; the heads' outputs (B, T, heads * head_dim), before the output
        projection."""
        batch, length = q.shape[:2]
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if ctx.cache is not None:
            k, v = ctx.cache.update(self.layer, k, v, ctx.slot)
        if self.observer is not None:
            self.observer(self, q, k, ctx)  # the module, not self.layer: compile would specialise on the int
        if ctx.backend == "flex":
            y = attn_lib.flex_attention(q, k, v, ctx.block_mask)
        elif ctx.backend == "xformers":
            y = attn_lib.xformers_attention(q, k, v, ctx.document_ids)
        else:
            y = attn_lib.sdpa_attention(q, k, v, ctx.mask)
        return y.transpose(1, 2).reshape(batch, length, -1)
