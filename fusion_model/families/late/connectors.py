"""The late-fusion connectors: LLaVA's projector, Flamingo's Perceiver resampler and gated cross-attention, BLIP-2's
Q-Former; each reads the frozen image tokenizer's pre-quantisation features."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


# ---- shared pieces -----------------------------------------------------------------------------------------------
class CrossAttention(nn.Module):
    """Multi-head attention of queries (B, Tq, query_dim) over keys/values (B, Tk, kv_dim), masked per query."""

    def __init__(self, query_dim: int, kv_dim: int, heads: int) -> None:
        super().__init__()
        if query_dim % heads:
            raise ValueError(f"CrossAttention: query_dim {query_dim} is not divisible by heads {heads}")
        self.heads = heads
        self.to_q = nn.Linear(query_dim, query_dim, bias=False)
        self.to_kv = nn.Linear(kv_dim, 2 * query_dim, bias=False)
        # no bias: a query that may see nothing gets exactly 0 out, not a learned constant
        self.out = nn.Linear(query_dim, query_dim, bias=False)

    def forward(self, queries: torch.Tensor, keys_values: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """mask (B, Tq, Tk) bool, True = may attend; a query with no True key gets exactly 0."""
        batch, length, dim = queries.shape
        # an explicit head size, not -1: a batch of no images (a text-only batch) has 0 rows to infer it from
        head_dim = dim // self.heads
        q = self.to_q(queries).view(batch, length, self.heads, head_dim).transpose(1, 2)
        k, v = self.to_kv(keys_values).view(batch, keys_values.shape[1], 2, self.heads, head_dim).unbind(2)
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        sees_any = None
        if mask is not None:
            sees_any = mask.any(-1, keepdim=True)  # (B, Tq, 1)
            # softmax over no key is 0/0: some SDPA kernels return NaN there, and NaN times a closed gate is
            # still NaN; let such a query attend everywhere, then zero its output below
            mask = (mask | ~sees_any)[:, None]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        y = self.out(y.transpose(1, 2).reshape(batch, length, dim))
        return y if sees_any is None else torch.where(sees_any, y, torch.zeros((), dtype=y.dtype, device=y.device))


def feed_forward(dim: int, mult: int = 4) -> nn.Sequential:
    """The GELU MLP Flamingo and BERT use: Linear(dim, mult*dim) -> GELU -> Linear(mult*dim, dim)."""
    return nn.Sequential(nn.Linear(dim, mult * dim), nn.GELU(), nn.Linear(mult * dim, dim))


# ---- LLaVA -------------------------------------------------------------------------------------------------------
class LlavaProjector(nn.Module):
    """LLaVA-1.5's connector: each patch feature -> one decoder input embedding, Linear -> GELU -> Linear."""

    def __init__(self, feature_dim: int, model_dim: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(feature_dim, model_dim), nn.GELU(), nn.Linear(model_dim, model_dim))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """features (B, P, feature_dim) -> embeddings (B, P, model_dim)."""
        return self.net(features)


# ---- Flamingo ----------------------------------------------------------------------------------------------------
class PerceiverResampler(nn.Module):
    """Flamingo's Perceiver resampler: K learned latents read any number of features; output (B, K, dim)."""

    def __init__(self, feature_dim: int, dim: int, num_latents: int = 64, depth: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.project = nn.Linear(feature_dim, dim)
        self.latents = nn.Parameter(torch.randn(num_latents, dim) * 0.02)
        self.layers = nn.ModuleList(
            nn.ModuleDict({
                "feature_norm": nn.LayerNorm(dim),
                "latent_norm": nn.LayerNorm(dim),
                "attn": CrossAttention(dim, dim, heads),
                "ff_norm": nn.LayerNorm(dim),
                "ff": feed_forward(dim),
            })
            for _ in range(depth)
        )
        self.norm = nn.LayerNorm(dim)

    def forward(self, features: torch.Tensor, feature_mask: torch.Tensor | None = None) -> torch.Tensor:
        """features (B, N, feature_dim), feature_mask (B, N) bool True = real feature -> latents (B, K, dim)."""
        x = self.project(features)
        batch, num_latents = x.shape[0], self.latents.shape[0]
        latents = self.latents.expand(batch, -1, -1)
        mask = None
        if feature_mask is not None:
            # every latent may read every real feature and every latent (the latents are never padding)
            keys = torch.cat([feature_mask, feature_mask.new_ones(batch, num_latents)], dim=1)
            mask = keys[:, None, :].expand(batch, num_latents, -1)
        for layer in self.layers:
            normed = layer["latent_norm"](latents)
            # Flamingo's keys/values are [features; latents]: the latents also attend to themselves, so each
            # layer can keep what it has gathered, and no latent ever sees an empty key set
            keys_values = torch.cat([layer["feature_norm"](x), normed], dim=1)
            latents = latents + layer["attn"](normed, keys_values, mask)
            latents = latents + layer["ff"](layer["ff_norm"](latents))
        return self.norm(latents)


def media_index(input_ids: torch.Tensor, image_token_id: int,
                document_ids: torch.Tensor | None = None) -> torch.Tensor:
    """(B, T) long: which image of its row each token follows (the latest `image_token_id` at or before it), -1 none.

    An image marker in an earlier document of a packed row is not "before" the token: its index is -1 there.
    """
    is_marker = input_ids == image_token_id
    count = is_marker.long().cumsum(dim=1)  # markers at or before each token, so the marker sees its own image
    index = count - 1
    if document_ids is not None:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        last_marker = torch.where(is_marker, positions, -1).cummax(dim=1).values
        marker_document = document_ids.gather(1, last_marker.clamp_min(0))
        same_document = (last_marker >= 0) & (marker_document == document_ids)
        index = torch.where(same_document, index, -1)
    return index


def media_mask(media_index_per_token: torch.Tensor, num_media: int) -> torch.Tensor:
    """(B, T, num_media) bool: each token may see only the image it follows (Flamingo's "immediately preceding")."""
    media = torch.arange(num_media, device=media_index_per_token.device)
    return media_index_per_token[..., None] == media  # -1 (no image yet) matches nothing


class GatedCrossAttention(nn.Module):
    """Flamingo's gated xattn-dense layer: tanh-gated cross-attention to media, then a tanh-gated FFN."""

    def __init__(self, dim: int, media_dim: int, heads: int) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(dim)
        self.attn = CrossAttention(dim, media_dim, heads)
        self.ff_norm = nn.LayerNorm(dim)
        self.ff = feed_forward(dim)
        # gates start closed: the frozen decoder's function is kept exactly at initialisation
        self.alpha_attn = nn.Parameter(torch.zeros(()))
        self.alpha_ff = nn.Parameter(torch.zeros(()))

    def forward(self, x: torch.Tensor, media: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """x (B, T, dim), media (B, M, K, media_dim) = K vectors per image, mask (B, T, M) bool -> (B, T, dim)."""
        batch, num_media, per_media, media_dim = media.shape
        keys_mask = mask.repeat_interleave(per_media, dim=-1)  # a token sees all K vectors of its image
        keys_values = media.reshape(batch, num_media * per_media, media_dim)
        x = x + self.alpha_attn.tanh() * self.attn(self.attn_norm(x), keys_values, keys_mask)
        return x + self.alpha_ff.tanh() * self.ff(self.ff_norm(x))


class FlamingoConnector(nn.Module):
    """The trainable half of Flamingo: one Perceiver resampler and a gated cross-attention layer per decoder block."""

    def __init__(self, feature_dim: int, model_dim: int, n_layers: int, media_dim: int, num_latents: int,
                 depth: int, heads: int) -> None:
        super().__init__()
        self.resampler = PerceiverResampler(feature_dim, media_dim, num_latents, depth, heads)
        self.gated = nn.ModuleList(GatedCrossAttention(model_dim, media_dim, heads) for _ in range(n_layers))


# ---- BLIP-2 ------------------------------------------------------------------------------------------------------
class QFormerLayer(nn.Module):
    """One Q-Former layer (BERT's post-norm): self-attention among queries, cross-attention to features, FFN."""

    def __init__(self, dim: int, feature_dim: int, heads: int) -> None:
        super().__init__()
        self.self_attn = CrossAttention(dim, dim, heads)
        self.self_norm = nn.LayerNorm(dim)
        self.cross_attn = CrossAttention(dim, feature_dim, heads)
        self.cross_norm = nn.LayerNorm(dim)
        self.ff = feed_forward(dim)
        self.ff_norm = nn.LayerNorm(dim)

    def forward(self, queries: torch.Tensor, features: torch.Tensor,
                feature_mask: torch.Tensor | None = None) -> torch.Tensor:
        """queries (B, M, dim), features (B, N, feature_dim) -> queries (B, M, dim)."""
        queries = self.self_norm(queries + self.self_attn(queries, queries))
        queries = self.cross_norm(queries + self.cross_attn(queries, features, feature_mask))
        return self.ff_norm(queries + self.ff(queries))


class QFormer(nn.Module):
    """BLIP-2's querying transformer: M learned queries read the image features; output (B, M, out_dim)."""

    def __init__(self, feature_dim: int, dim: int, num_queries: int = 32, depth: int = 2, heads: int = 4, *,
                 out_dim: int) -> None:
        super().__init__()
        # BLIP-2 normalises the frozen encoder's output before the Q-Former reads it (its ln_vision)
        self.feature_norm = nn.LayerNorm(feature_dim)
        self.queries = nn.Parameter(torch.randn(num_queries, dim) * 0.02)
        self.query_norm = nn.LayerNorm(dim)  # BERT's embedding LayerNorm, applied to the queries
        self.layers = nn.ModuleList(QFormerLayer(dim, feature_dim, heads) for _ in range(depth))
        self.to_language_model = nn.Linear(dim, out_dim)  # BLIP-2's language_projection

    def forward(self, features: torch.Tensor, feature_mask: torch.Tensor | None = None) -> torch.Tensor:
        """features (B, N, feature_dim), feature_mask (B, N) bool True = real -> (B, M, out_dim)."""
        features = self.feature_norm(features)
        batch = features.shape[0]
        queries = self.query_norm(self.queries).expand(batch, -1, -1)
        mask = None if feature_mask is None else feature_mask[:, None, :].expand(-1, queries.shape[1], -1)
        for layer in self.layers:
            queries = layer(queries, features, mask)
        return self.to_language_model(queries)
