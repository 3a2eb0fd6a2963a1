"""The dense block: Chameleon's decoder layer, one set of weights for every token (pre-norm or swin norm)."""

from __future__ import annotations

import torch
from torch import nn

from fusion_model.config import FusionConfig
from fusion_model.layers.attention import Attention, AttentionContext
from fusion_model.layers.mlp import MLP
from fusion_model.layers.norms import RMSNorm


class DenseBlock(nn.Module):
    """One decoder layer, the dense block: pre-norm x + f(norm(x)) or swin norm x + norm(f(x)).

    The contract every block (`fusion_model.blocks`) keeps: built as cls(config, layer), called as
    block(x, cos, sin, ctx) -> x, its attention at `.attn` (an `Attention`, whose observer the stability monitor
    sets), and the class-level methods below: the config check and the closed-form parameter counts.
    """

    uses_modality = False  # whether forward reads ctx.modality_groups (the model finds them only then)

    def __init__(self, config: FusionConfig, layer: int) -> None:
        super().__init__()
        self.swin = config.norm_placement == "swin"
        self.attn_norm = RMSNorm(config.dim, config.norm_eps)
        self.attn = Attention(config.dim, config.n_heads, config.kv_heads, config.qk_norm, layer)
        self.mlp_norm = RMSNorm(config.dim, config.norm_eps)
        self.mlp = MLP(config.dim, config.hidden_dim)
        self.dropout = nn.Dropout(config.dropout)

    @classmethod
    def check_config(cls, config: FusionConfig) -> None:
        """Refuse settings this block cannot build (the dense block takes no options)."""
        if config.block_options:
            raise ValueError(f"FusionConfig: block {config.block!r} takes no block_options, got {dict(config.block_options)}")

    @classmethod
    def layer_parameters(cls, config: FusionConfig) -> int:
        """Parameters of one block, closed form."""
        return sum(config.layer_part_parameters().values())

    @classmethod
    def active_layer_parameters(cls, config: FusionConfig) -> int:
        """Parameters one token runs through: all of them."""
        return cls.layer_parameters(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """x: (B, T, dim) -> (B, T, dim)."""
        if self.swin:
            h = x + self.dropout(self.attn_norm(self.attn(x, cos, sin, ctx)))
            return h + self.dropout(self.mlp_norm(self.mlp(h)))
        h = x + self.dropout(self.attn(self.attn_norm(x), cos, sin, ctx))
        return h + self.dropout(self.mlp(self.mlp_norm(h)))
