"""Mixture-of-Transformers block (Liang et al. 2024, arXiv 2411.04996): weights per modality, one global attention.

Each token runs through its own modality's copy of the feed-forward, the attention projections (Q, K, V, O) and
the norms (the layer's two RMSNorms and QK-norm), while attention itself stays global over the packed row with
the document masks of the dense block. Tokens are gathered by modality, run through that modality's weights and
scattered back, so a token costs the dense block's FLOPs, never both copies'. Each part can stay shared
(`block_options`: ffn, attention, norms) to reproduce the paper's ablation; with all three shared the block
computes the dense block's function.

Modality comes from the ids once per forward (`fusion_model.model.modality_groups`): image codes are image,
every other id (text, specials, <boi>/<eoi>) is text.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from fusion_model.config import FusionConfig
from fusion_model.layers import roles
from fusion_model.layers.attention import Attention, AttentionContext
from fusion_model.layers.mlp import MLP
from fusion_model.layers.norms import QKNorm, RMSNorm

# The group indices come from `nonzero` (data-dependent sizes): let the compiler keep them in its graph, so
# a compiled block or decode step stays one graph (fullgraph=True) instead of breaking at each gather.
torch._dynamo.config.capture_dynamic_output_shape_ops = True

MODALITIES = ("text", "image")  # the order of ctx.modality_groups


@dataclass(frozen=True)
class MoTOptions:
    """Which parts of the block have a copy per modality (`--model.config.block_options`)."""

    ffn: bool = True  # the SwiGLU feed-forward
    attention: bool = True  # the Q, K, V and O projections
    norms: bool = True  # the layer's two RMSNorms and, with qk_norm, QK-norm

    @classmethod
    def from_config(cls, config: FusionConfig) -> MoTOptions:
        """The options in config.block_options; an unknown key or a value that is not a bool is refused."""
        known = [f.name for f in dataclasses.fields(cls)]
        values = dict(config.block_options)
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ValueError(f"FusionConfig: block 'mot' has no option {unknown}; its options are {known} "
                             "(--model.config.block_options)")
        for name, value in values.items():
            if not isinstance(value, bool):
                raise ValueError(f"FusionConfig: block_options.{name}={value!r} must be true or false")
        return cls(**values)


class AttentionInput(nn.Linear):
    """The fused Q, K, V projection of one modality (or of both, when shared)."""

    PARAMETER_ROLES = {"weight": roles.ATTENTION}


class AttentionOutput(nn.Linear):
    """The output projection of one modality (or of both, when shared)."""

    PARAMETER_ROLES = {"weight": roles.ATTENTION_OUTPUT}


def per_modality(separate: bool, build: Callable[[], nn.Module]) -> nn.Module:
    """{"text": copy, "image": copy} when `separate`, else one module both modalities share."""
    return nn.ModuleDict({name: build() for name in MODALITIES}) if separate else build()


def for_modality(module: nn.Module, name: str) -> nn.Module:
    """The copy of `module` that modality `name` runs (the module itself when shared)."""
    return module[name] if isinstance(module, nn.ModuleDict) else module


class _Gather(torch.autograd.Function):
    """Each group's rows of x (N, features); the groups partition the rows, so the backward writes every group's
    gradient into one buffer (autograd's index_select backward zero-fills a full-size buffer per group and sums)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, groups: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        ctx.groups = groups
        return tuple(x.index_select(0, index) for index in groups)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        grad = grads[0].new_empty(sum(len(g) for g in grads), *grads[0].shape[1:])
        for index, part in zip(ctx.groups, grads):
            grad.index_copy_(0, index, part)
        return grad, None


class _Scatter(torch.autograd.Function):
    """The groups' rows put back in token order (N, features); the backward gathers the gradient by group (autograd's
    index_copy_ backward also copies the whole gradient for the buffer written into)."""

    @staticmethod
    def forward(ctx, groups: tuple[torch.Tensor, ...], *parts: torch.Tensor) -> torch.Tensor:
        ctx.groups = groups
        out = parts[0].new_empty(sum(len(p) for p in parts), *parts[0].shape[1:])
        for index, part in zip(groups, parts):
            out.index_copy_(0, index, part)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return None, *(grad.index_select(0, index) for index in ctx.groups)


class _Join(torch.autograd.Function):
    """`main` unchanged, with the zero-row outputs of a modality absent from the batch joined to the graph: the
    backward then reaches that modality's weights (zero gradients, not None) without a copy of `main`."""

    @staticmethod
    def forward(ctx, main: torch.Tensor, *empty: torch.Tensor) -> torch.Tensor:
        ctx.shapes = [e.shape for e in empty]
        return main.view_as(main)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, *(grad.new_zeros(shape) for shape in ctx.shapes)


Outputs = torch.Tensor | tuple[torch.Tensor, ...]


def by_modality(x: torch.Tensor, groups: tuple[torch.Tensor, ...],
                fn: Callable[[str, torch.Tensor], Outputs]) -> Outputs:
    """fn(modality, its tokens (n, features)) on each modality's tokens of x (..., features); each output of fn
    (n, ...) put back in token order, (..., ...).

    A modality absent from the batch runs on zero tokens whenever autograd records: its weights still join the
    backward (with zero gradients), so every rank's backward reaches every parameter and DDP / FSDP2 collectives
    stay in step. Without autograd (decoding) it is skipped.
    """
    flat = x.reshape(-1, x.shape[-1])
    if torch.compiler.is_compiling():
        # the group sizes are symbolic here (nonzero): no branch on them, plain ops the compiler fuses
        merged = _gather_scatter(flat, groups, fn)
    else:
        recording = torch.is_grad_enabled()
        full = next((i for i, index in enumerate(groups) if len(index) == len(flat)), None)
        if full is not None:
            # one modality holds every token (text-only rows, a decode step in one modality): no gather, no scatter
            merged = list(_as_tuple(fn(MODALITIES[full], flat)))
            if recording:
                empty = [_as_tuple(fn(name, flat.new_empty(0, flat.shape[1])))
                         for i, name in enumerate(MODALITIES) if i != full]
                merged = [_Join.apply(out, *parts) for out, *parts in zip(merged, *empty)]
        elif recording:
            outputs = [_as_tuple(fn(name, tokens)) for name, tokens in zip(MODALITIES, _Gather.apply(flat, groups))]
            merged = [_Scatter.apply(groups, *parts) for parts in zip(*outputs)]
        else:
            merged = _gather_scatter(flat, groups, fn)
    shaped = tuple(out.view(*x.shape[:-1], *out.shape[1:]) for out in merged)
    return shaped if len(shaped) > 1 else shaped[0]


def _as_tuple(value: Outputs) -> tuple[torch.Tensor, ...]:
    """A function's output(s) as a tuple."""
    return value if isinstance(value, tuple) else (value,)


def _gather_scatter(flat: torch.Tensor, groups: tuple[torch.Tensor, ...],
                    fn: Callable[[str, torch.Tensor], Outputs]) -> list[torch.Tensor]:
    """by_modality with plain index_select / index_copy_ (what the compiler traces, and decoding runs)."""
    outputs = [_as_tuple(fn(name, flat.index_select(0, index))) for name, index in zip(MODALITIES, groups)]
    merged = []
    for parts in zip(*outputs):
        out = parts[0].new_empty(len(flat), *parts[0].shape[1:])
        for index, part in zip(groups, parts):
            out.index_copy_(0, index, part)
        merged.append(out)
    return merged


class MoTAttention(Attention):
    """Attention with Q, K, V, O and QK-norm per modality (as the options say); the attention itself is global."""

    PARAMETER_ROLES: dict[str, str] = {}  # the projections declare their own roles, shared or per modality

    def __init__(self, config: FusionConfig, layer: int) -> None:
        # read by build_projections, which the base constructor calls (a plain value may be set before it)
        self.options = MoTOptions.from_config(config)
        super().__init__(config.dim, config.n_heads, config.kv_heads, config.qk_norm, layer)

    def build_projections(self, dim: int, qk_norm: bool) -> None:
        """The projections and QK-norm: a copy per modality or shared, as the block's options say."""
        options = self.options
        qkv_width, heads_width = (self.n_heads + 2 * self.kv_heads) * self.head_dim, self.n_heads * self.head_dim
        self.qkv = per_modality(options.attention, lambda: AttentionInput(dim, qkv_width, bias=False))
        self.out = per_modality(options.attention, lambda: AttentionOutput(heads_width, dim, bias=False))
        self.q_norm = per_modality(options.norms, lambda: QKNorm(self.n_heads, self.head_dim)) if qk_norm else None
        self.k_norm = per_modality(options.norms, lambda: QKNorm(self.kv_heads, self.head_dim)) if qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: AttentionContext,
                input_norm: nn.Module | None = None, output_norm: nn.Module | None = None) -> torch.Tensor:
        """x: (B, T, dim) -> (B, T, dim); `input_norm` (pre-norm) and `output_norm` (swin norm), shared or per
        modality, run inside the same gather as the projections."""
        groups = ctx.modality_groups
        batch, length, _ = x.shape
        split = [self.n_heads, self.kv_heads, self.kv_heads]

        def project_in(name: str, tokens: torch.Tensor) -> tuple[torch.Tensor, ...]:
            if input_norm is not None:
                tokens = for_modality(input_norm, name)(tokens)
            qkv = for_modality(self.qkv, name)(tokens).view(len(tokens), sum(split), self.head_dim)
            q, k, v = qkv.split(split, dim=1)
            if self.q_norm is None:
                return q, k, v
            # three outputs, each put back in order on its own: no torch.cat of the normed q and k with v
            return for_modality(self.q_norm, name)(q), for_modality(self.k_norm, name)(k), v

        def project_out(name: str, heads: torch.Tensor) -> torch.Tensor:
            out = for_modality(self.out, name)(heads)
            return out if output_norm is None else for_modality(output_norm, name)(out)

        q, k, v = by_modality(x, groups, project_in)
        return by_modality(self.attend(q, k, v, cos, sin, ctx), groups, project_out)


class MoTBlock(nn.Module):
    """A decoder layer with weights per modality: pre-norm x + f_m(norm_m(x)) or swin norm x + norm_m(f_m(x)),
    where m is each token's modality and the attention inside f sees every token of the row's document."""

    uses_modality = True

    def __init__(self, config: FusionConfig, layer: int) -> None:
        super().__init__()
        options = MoTOptions.from_config(config)
        self.swin = config.norm_placement == "swin"
        self.attn_norm = per_modality(options.norms, lambda: RMSNorm(config.dim, config.norm_eps))
        self.attn = MoTAttention(config, layer)
        self.mlp_norm = per_modality(options.norms, lambda: RMSNorm(config.dim, config.norm_eps))
        self.mlp = per_modality(options.ffn, lambda: MLP(config.dim, config.hidden_dim))
        self.dropout = nn.Dropout(config.dropout)

    @classmethod
    def check_config(cls, config: FusionConfig) -> None:
        """Refuse unknown options, and a config without an image block (nothing to tell the modalities apart)."""
        MoTOptions.from_config(config)
        if config.image_offset is None:
            raise ValueError("FusionConfig: block 'mot' needs the vocabulary's image block (image_offset and "
                             "image_codes) to tell image tokens from text")

    @classmethod
    def layer_parameters(cls, config: FusionConfig) -> int:
        """Parameters of one block, closed form: each separate part counted once per modality."""
        options = MoTOptions.from_config(config)
        parts = config.layer_part_parameters()
        copies = {"attention": options.attention, "ffn": options.ffn, "norms": options.norms, "qk_norm": options.norms}
        return sum(size * (len(MODALITIES) if copies[part] else 1) for part, size in parts.items())

    @classmethod
    def active_layer_parameters(cls, config: FusionConfig) -> int:
        """Parameters one token runs through: one copy of each part, the dense block's count."""
        return sum(config.layer_part_parameters().values())

    @staticmethod
    def dense_name(name: str) -> str:
        """The dense block's name for one of this block's parameters ("mlp.image.down.weight" -> "mlp.down.weight"):
        what upcycling copies each modality's weight from."""
        return ".".join(part for part in name.split(".") if part not in MODALITIES)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """x: (B, T, dim) -> (B, T, dim)."""
        groups = ctx.modality_groups
        if groups is None:
            raise ValueError("MoTBlock: the attention context has no modality_groups (FusionModel.attention_context "
                             "finds them for blocks with uses_modality)")
        if self.swin:
            h = x + self.dropout(self.attn(x, cos, sin, ctx, output_norm=self.attn_norm))
            f = by_modality(h, groups, lambda name, t: for_modality(self.mlp_norm, name)(for_modality(self.mlp, name)(t)))
        else:
            h = x + self.dropout(self.attn(x, cos, sin, ctx, input_norm=self.attn_norm))
            f = by_modality(h, groups, lambda name, t: for_modality(self.mlp, name)(for_modality(self.mlp_norm, name)(t)))
        return h + self.dropout(f)
