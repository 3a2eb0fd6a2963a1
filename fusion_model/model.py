"""The fused decoder: Chameleon's transformer (QK-norm, pre or swin norm, SwiGLU, RoPE) over packed rows."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from fusion_model import attention as attn_lib
from fusion_model import roles
from fusion_model.blocks import block_class
from fusion_model.config import FusionConfig
from fusion_model.loss import fusion_loss_from_hidden
from tokenizer.layout import image_position_mask


class _RMSNorm(torch.autograd.Function):
    """fp32 RMSNorm: aten's fused forward kernel, and a hand-written backward.

    On CPU aten has no fused RMSNorm backward; autograd's version of the decomposed formula takes about
    twelve elementwise passes, this one six (fwd + bwd 3.3 against 5.4 ms at (2, 512, 512), 1 thread).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        y, rstd = torch.ops.aten._fused_rms_norm(x, [x.shape[-1]], weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        x_hat = x * rstd
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = (grad_y * x_hat).sum(dim=tuple(range(grad_y.dim() - 1)))
        # d x = rstd * (g - x_hat * mean(g * x_hat)), g = grad_y * weight
        g = grad_y * weight
        grad_x = torch.addcmul(g, x_hat, (g * x_hat).mean(-1, keepdim=True), value=-1).mul_(rstd)
        return grad_x, grad_weight, None


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 (as transformers' Chameleon), weight applied in the input dtype."""

    PARAMETER_ROLES = {"weight": roles.NORM}

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        """The identity: gain 1."""
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise the last dimension."""
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            if torch.compiler.is_compiling():  # the compiler fuses the formula itself
                return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
            return _RMSNorm.apply(x, self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), self.weight.shape, None, self.eps).to(x.dtype)


class QKNorm(nn.Module):
    """Chameleon's QK-norm: LayerNorm over head_dim without affine, then a per-head weight and bias."""

    # the weight is (heads, head_dim): a gain per head, not a matrix, whatever its shape
    PARAMETER_ROLES = {"weight": roles.NORM, "bias": roles.NORM}

    def __init__(self, heads: int, head_dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(heads, head_dim))
        self.bias = nn.Parameter(torch.zeros(heads, head_dim))

    def reset_parameters(self) -> None:
        """The plain LayerNorm: gain 1, bias 0."""
        nn.init.ones_(self.weight)
        nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, T, heads, head_dim)."""
        return F.layer_norm(x, x.shape[-1:], None, None, eps=1e-5) * self.weight + self.bias


def rope_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos/sin tables (B, 1, T, head_dim) for the rotate_half convention, computed in fp32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float, device=position_ids.device) / head_dim))
    freqs = position_ids[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]
    return emb.cos().to(dtype), emb.sin().to(dtype)


class _RotateHalf(torch.autograd.Function):
    """x * cos + rotate_half(x) * sin with a hand-written backward.

    Autograd through `cat((-x2, x1))` allocates the rotated copy, and in backward a zero-filled full-size
    tensor per slice; writing the two halves with addcmul_ takes half the time (fwd + bwd, q at T 512 on CPU).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        out = x * cos
        out[..., :half].addcmul_(x[..., half:], sin[..., :half], value=-1)
        out[..., half:].addcmul_(x[..., :half], sin[..., half:])
        ctx.save_for_backward(cos, sin)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        cos, sin = ctx.saved_tensors
        half = grad_out.shape[-1] // 2
        # the transpose of the rotation: d x1 = d1 cos1 + d2 sin2, d x2 = d2 cos2 - d1 sin1
        grad = grad_out * cos
        grad[..., :half].addcmul_(grad_out[..., half:], sin[..., half:])
        grad[..., half:].addcmul_(grad_out[..., :half], sin[..., :half], value=-1)
        return grad, None, None


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (B, H, T, hd) by the position angles (rotate_half convention, as LLaMA/Chameleon)."""
    return _RotateHalf.apply(x, cos, sin)


class _SwiGLU(torch.autograd.Function):
    """silu(gate) * up of the fused gate/up projection output, with a hand-written backward.

    Autograd's version saves silu(gate) besides the projection output and `cat`s the two gradients into a
    fresh tensor; this one saves only the projection output and writes both gradients into one buffer.
    """

    @staticmethod
    def forward(ctx, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        ctx.save_for_backward(gate_up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (gate_up,) = ctx.saved_tensors
        gate, up = gate_up.chunk(2, dim=-1)
        if torch.compiler.is_compiling():  # the compiler fuses the cat itself and wants no out= views
            return torch.cat([torch.ops.aten.silu_backward(grad_out * up, gate), grad_out * F.silu(gate)], dim=-1)
        grad = torch.empty_like(gate_up)
        grad_gate, grad_up = grad.chunk(2, dim=-1)
        torch.ops.aten.silu_backward.grad_input(grad_out * up, gate, grad_input=grad_gate)
        torch.mul(grad_out, F.silu(gate), out=grad_up)
        return grad


def _one_document_per_row(document_ids: torch.Tensor) -> bool:
    """Whether every row is a single document without padding (reads the ids: a device sync on GPUs)."""
    return bool(((document_ids == document_ids[:, :1]) & (document_ids >= 0)).all())


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


def modality_groups(input_ids: torch.Tensor, config: FusionConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat indices into (B * T) of the text tokens and of the image tokens.

    Image = an image-code id or the config's continuous-image placeholder id (the one image-position rule,
    `tokenizer.layout.image_position_mask`); everything else, text specials and <boi>/<eoi> included, is text.
    """
    is_image = image_position_mask(input_ids, config.image_offset, config.image_codes,
                                   config.image_placeholder_id).reshape(-1)
    return (~is_image).nonzero().squeeze(1), is_image.nonzero().squeeze(1)


class KVCache:
    """Preallocated keys/values per layer (B, n_kv_heads, max_len, head_dim), with each cached key's
    document id and position; `length` keys are filled. Rows share one length (left-pad prompts
    with document id -1)."""

    def __init__(self, n_layers: int, batch_size: int, n_kv_heads: int, max_len: int, head_dim: int,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        shape = (batch_size, n_kv_heads, max_len, head_dim)
        dtype = dtype or torch.get_default_dtype()
        self.keys = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layers)]
        self.values = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layers)]
        self.document_ids = torch.full((batch_size, max_len), -1, dtype=torch.long, device=device)
        self.positions = torch.zeros((batch_size, max_len), dtype=torch.long, device=device)
        self.length = 0
        self.max_len = max_len
        self.batch_size = batch_size

    def reset(self) -> None:
        """Forget every cached token (the buffers are reused)."""
        self.length = 0
        self.document_ids.fill_(-1)

    def truncate(self, length: int) -> None:
        """Forget every cached token from `length` on (a rollback, e.g. of rejected drafts appended by a forward).

        The keys before `length` stay valid: causal attention never let them see the tokens after (unless
        image_bidirectional let image tokens fed in one forward see each other).
        """
        if not 0 <= length <= self.length:
            raise ValueError(f"KVCache.truncate: length {length} is outside [0, {self.length}] (the cached tokens)")
        self.document_ids[:, length : self.length] = -1
        self.length = length

    def reserve(self, document_ids: torch.Tensor, position_ids: torch.Tensor) -> None:
        """Record the metadata of the next T tokens (called once per forward, before the layers)."""
        batch, length = document_ids.shape
        if batch != self.batch_size:
            raise ValueError(f"KVCache: batch {batch} does not match the cache's batch size {self.batch_size}")
        if self.length + length > self.max_len:
            raise ValueError(
                f"KVCache: {self.length} cached + {length} new tokens exceed max_len {self.max_len}; "
                "create the cache with a larger max_len"
            )
        self.document_ids[:, self.length : self.length + length] = document_ids
        self.positions[:, self.length : self.length + length] = position_ids

    def record_at(self, slot: torch.Tensor, document_ids: torch.Tensor, position_ids: torch.Tensor) -> None:
        """Record T tokens per row (B, T) from each row's cache index slot[b] on: the static decode step's reserve."""
        index = slot[:, None] + torch.arange(document_ids.shape[1], device=slot.device)
        self.document_ids.scatter_(1, index, document_ids)
        self.positions.scatter_(1, index, position_ids)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor,
               slot: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this layer's new keys/values at `length` and return all keys/values up to the new end; with `slot`
        ((B,): each row's cache index) write row b's T new ones from slot[b] on and return the whole buffers
        (fixed shapes, no host sync)."""
        if slot is not None:
            batch, heads, length, dim = k.shape
            index = (slot[:, None] + torch.arange(length, device=slot.device))[:, None, :, None]
            index = index.expand(batch, heads, length, dim)
            self.keys[layer].scatter_(2, index, k)
            self.values[layer].scatter_(2, index, v)
            return self.keys[layer], self.values[layer]
        end = self.length + k.shape[2]
        self.keys[layer][:, :, self.length : end] = k
        self.values[layer][:, :, self.length : end] = v
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]


class Attention(nn.Module):
    """Multi-head (optionally grouped-query) self-attention with QK-norm before RoPE; fused QKV projection."""

    PARAMETER_ROLES = {"qkv.weight": roles.ATTENTION, "out.weight": roles.ATTENTION_OUTPUT}

    def __init__(self, config: FusionConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.n_heads, self.kv_heads, self.head_dim = config.n_heads, config.kv_heads, config.head_dim
        self.build_projections(config)
        # a monitor (fusion_model.training.monitors) sets a callable(attention, q, k, ctx) here to see what the
        # scores are made of; None, the default, costs one attribute check and changes nothing
        self.observer = None

    def build_projections(self, config: FusionConfig) -> None:
        """The fused QKV and output projections and QK-norm (a block with weights per modality builds its own)."""
        self.qkv = nn.Linear(config.dim, (self.n_heads + 2 * self.kv_heads) * self.head_dim, bias=False)
        self.out = nn.Linear(self.n_heads * self.head_dim, config.dim, bias=False)
        self.q_norm = QKNorm(self.n_heads, self.head_dim) if config.qk_norm else None
        self.k_norm = QKNorm(self.kv_heads, self.head_dim) if config.qk_norm else None

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


class MLP(nn.Module):
    """SwiGLU feed-forward down(silu(gate(x)) * up(x)), gate and up fused into one matmul."""

    PARAMETER_ROLES = {"gate_up.weight": roles.MLP, "down.weight": roles.MLP_OUTPUT}

    def __init__(self, config: FusionConfig) -> None:
        super().__init__()
        self.gate_up = nn.Linear(config.dim, 2 * config.hidden_dim, bias=False)
        self.down = nn.Linear(config.hidden_dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, T, dim) -> (B, T, dim)."""
        return self.down(_SwiGLU.apply(self.gate_up(x)))


class Block(nn.Module):
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
        self.attn = Attention(config, layer)
        self.mlp_norm = RMSNorm(config.dim, config.norm_eps)
        self.mlp = MLP(config)
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


class FusionModel(nn.Module):
    """Decoder-only transformer over the unified text+image vocabulary (untied embedding and head)."""

    PARAMETER_ROLES = {"embed.weight": roles.EMBEDDING, "head.weight": roles.OUTPUT_HEAD}
    supports_kv_cache = True  # the sampler's cached decode path (decode_hidden, new_kv_cache) works

    def __init__(self, config: FusionConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.dim)
        block = block_class(config.block)
        self.layers = nn.ModuleList(block(config, i) for i in range(config.n_layers))
        self.uses_modality = block.uses_modality
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.head = nn.Linear(config.dim, config.vocab_size, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Normal(0, init_std) for matrices; the residual-output projections' scaled by 1/sqrt(2 L) (GPT-2); norms
        to the identity. Roles as the modules declare them (`fusion_model.roles`)."""
        std = self.config.init_std
        for _, p, role in roles.parameter_roles(self):  # in parameter order: the random draws stay in that order
            if p.dim() < 2 or role == roles.NORM:
                continue
            scale = (2 * self.config.n_layers) ** -0.5 if role in roles.RESIDUAL_OUTPUTS else 1.0
            nn.init.normal_(p, mean=0.0, std=std * scale)
        for module in self.modules():
            if isinstance(module, (RMSNorm, QKNorm)):
                module.reset_parameters()

    # ---- attention bookkeeping ------------------------------------------------------------------
    def _backend(self, device: torch.device, cached: bool, limited: bool = False) -> str:
        backend = self.config.attention_backend
        if backend == "auto":
            backend = "flex" if device.type == "cuda" and not cached else "sdpa"
        if backend == "xformers" and (cached or self.config.image_bidirectional or limited):
            raise ValueError("attention_backend='xformers' supports neither a KV cache, image_bidirectional nor "
                             "visible_from; use 'sdpa' or 'flex'")
        return backend

    def _image_runs(self, input_ids: torch.Tensor) -> torch.Tensor | None:
        if not self.config.image_bidirectional:
            return None
        return attn_lib.image_runs(input_ids, self.config.image_offset, self.config.image_codes,
                                   self.config.image_placeholder_id)

    def attention_context(self, input_ids: torch.Tensor, document_ids: torch.Tensor | None,
                          position_ids: torch.Tensor | None, kv_cache: KVCache | None,
                          visible_from: torch.Tensor | None = None) -> tuple[AttentionContext, torch.Tensor]:
        """What every block of one forward reads: (the AttentionContext: backend, mask, cache; the position ids).

        Resolves the defaults forward_hidden documents (document ids: one document per row; positions: restarted
        per document, or continued from the cache) and builds the mask. Code that runs the blocks itself (the
        stability monitor, to see each block's output without a hook) calls it to run them as the forward does.
        """
        batch, length = input_ids.shape
        device = input_ids.device
        explicit_docs = document_ids is not None
        if document_ids is None:
            document_ids = torch.zeros_like(input_ids)
        start = 0 if kv_cache is None else kv_cache.length
        if position_ids is None:
            if kv_cache is not None and start > 0:
                position_ids = attn_lib.positions_from_documents(
                    document_ids, kv_cache.positions[:, start - 1] + 1, kv_cache.document_ids[:, start - 1]
                )
            elif explicit_docs:
                position_ids = attn_lib.positions_from_documents(document_ids)
            else:
                position_ids = torch.arange(length, device=device).expand(batch, length)
        backend = self._backend(device, kv_cache is not None, visible_from is not None)
        ctx = AttentionContext(backend=backend, cache=kv_cache, document_ids=document_ids)
        if self.uses_modality:
            ctx.modality_groups = modality_groups(input_ids, self.config)
        runs = self._image_runs(input_ids)
        if kv_cache is not None:
            kv_cache.reserve(document_ids, position_ids)
            end = start + length
            doc_k = kv_cache.document_ids[:, :end]
            # image runs are only known inside this chunk: a prompt's images are bidirectional at prefill,
            # tokens generated one at a time stay causal
            run_k = None if runs is None else torch.cat([torch.full_like(doc_k[:, :start], -1), runs], dim=1)
            q_index = torch.arange(start, end, device=device)
            ctx.mask = attn_lib.build_mask(document_ids, doc_k, q_index, torch.arange(end, device=device), runs, run_k,
                                           visible_from)
        elif backend == "flex":
            ctx.block_mask = attn_lib.flex_block_mask(document_ids, document_ids, 0, runs, runs, visible_from)
        elif backend == "sdpa" and (explicit_docs or runs is not None or visible_from is not None) and not (
            runs is None and visible_from is None and device.type == "cpu" and _one_document_per_row(document_ids)
        ):
            # (one whole document per row is plain causal attention: SDPA's is_causal kernel skips the
            # blocks above the diagonal, 1.35x faster than the same mask as a tensor at T 512 on CPU)
            index = torch.arange(length, device=device)
            ctx.mask = attn_lib.build_mask(document_ids, document_ids, index, index, runs, runs, visible_from)
        return ctx, position_ids

    # ---- forward --------------------------------------------------------------------------------
    def forward_hidden(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                       document_ids: torch.Tensor | None = None, kv_cache: KVCache | None = None, *,
                       inputs_embeds: torch.Tensor | None = None, before_layer=None,
                       visible_from: torch.Tensor | None = None) -> torch.Tensor:
        """Final normed hidden states (B, T, dim); see forward for the arguments.

        For connectors that feed the decoder something other than its own embeddings (late fusion, Transfusion's
        latent patches): `inputs_embeds` (B, T, dim) replaces the embedding lookup (input_ids still give the shape,
        documents and image runs); `before_layer(index, x) -> x` runs before each block (e.g. a gated
        cross-attention layer). `visible_from` (B, T) narrows attention: each query sees no key before that key
        index (a cache index under kv_cache), e.g. an image trained without its caption (classifier-free guidance).
        """
        if input_ids.dim() != 2:
            raise ValueError(f"FusionModel: input_ids must be (batch, seq), got shape {tuple(input_ids.shape)}")
        # on CPU a bad id gets a clear message; on CUDA the check would sync every step (and the kernel asserts)
        if input_ids.device.type == "cpu" and input_ids.numel() and int(input_ids.max()) >= self.config.vocab_size:
            raise ValueError(f"FusionModel: token id {int(input_ids.max())} >= vocab_size {self.config.vocab_size}")
        if inputs_embeds is not None and inputs_embeds.shape != (*input_ids.shape, self.config.dim):
            raise ValueError(f"FusionModel: inputs_embeds must be {(*input_ids.shape, self.config.dim)} (input_ids' "
                             f"shape by dim), got {tuple(inputs_embeds.shape)}")
        ctx, position_ids = self.attention_context(input_ids, document_ids, position_ids, kv_cache, visible_from)
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        cos, sin = rope_cos_sin(position_ids, self.config.head_dim, self.config.rope_theta, x.dtype)
        for index, block in enumerate(self.layers):
            if before_layer is not None:
                x = before_layer(index, x)
            if self.config.gradient_checkpointing and self.training and torch.is_grad_enabled():
                x = checkpoint(block, x, cos, sin, ctx, use_reentrant=False)
            else:
                x = block(x, cos, sin, ctx)
        if kv_cache is not None:
            kv_cache.length += input_ids.shape[1]
        return self.norm(x)

    def decode_hidden(self, tokens: torch.Tensor, positions: torch.Tensor, documents: torch.Tensor,
                      slot: torch.Tensor, kv_cache: KVCache) -> torch.Tensor:
        """The decode path: T new tokens per row (B, T), row b's written at cache indices slot[b], slot[b] + 1, ...;
        normed hidden (B, T, dim). Every shape is fixed (each query attends over the whole preallocated cache,
        masked by the cached document ids and by cache index) and nothing is read back to the host, so the step
        compiles to one graph. The plain sampler feeds T = 1; speculative decoding feeds a token and its drafts,
        and rows then move on by different counts. Prefill goes through forward_hidden. `kv_cache.length` is
        left to the caller: keys past a row's newest token are never read, so the next chunk overwrites them."""
        kv_cache.record_at(slot, documents, positions)
        keys = torch.arange(kv_cache.max_len, device=tokens.device)
        queries = slot[:, None] + torch.arange(tokens.shape[1], device=tokens.device)
        # generated tokens stay causal inside images (as in forward_hidden), so no image runs here
        mask = attn_lib.build_mask(documents, kv_cache.document_ids, queries, keys)
        ctx = AttentionContext(backend="sdpa", mask=mask, cache=kv_cache, slot=slot)
        if self.uses_modality:
            ctx.modality_groups = modality_groups(tokens, self.config)
        x = self.embed(tokens)
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, x.dtype)
        for block in self.layers:
            x = block(x, cos, sin, ctx)
        return self.norm(x)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                document_ids: torch.Tensor | None = None, kv_cache: KVCache | None = None) -> torch.Tensor:
        """Logits (B, T, vocab) in fp32.

        document_ids (B, T): packed documents, -1 for padding; attention stays inside a document and
        is causal. position_ids restart per document (derived from document_ids when None). With
        kv_cache, the T tokens are appended at cache.length and attend to every cached key of their
        document.
        """
        return self.head(self.forward_hidden(input_ids, position_ids, document_ids, kv_cache)).float()

    def loss(self, input_ids: torch.Tensor, document_ids: torch.Tensor | None = None,
             position_ids: torch.Tensor | None = None, *, text_weight: float = 1.0, image_weight: float = 1.0,
             chunk_size: int = 4096) -> dict:
        """fusion_loss without materialising all logits: the head + CE run in checkpointed token chunks."""
        if document_ids is None:
            document_ids = torch.zeros_like(input_ids)
        hidden = self.forward_hidden(input_ids, position_ids, document_ids)
        return fusion_loss_from_hidden(
            hidden, self.head.weight, input_ids, document_ids,
            image_offset=self.config.image_offset, image_codes=self.config.image_codes,
            z_loss_coef=self.config.z_loss_coef, text_weight=text_weight, image_weight=image_weight,
            chunk_size=chunk_size,
        )

    def hidden_and_loss(self, input_ids: torch.Tensor, document_ids: torch.Tensor,
                        position_ids: torch.Tensor | None = None, *, replace: torch.Tensor | None = None,
                        replacement: torch.Tensor | None = None, visible_from: torch.Tensor | None = None,
                        ignore_id: int | None = None, text_weight: float = 1.0, image_weight: float = 1.0,
                        chunk_size: int = 4096) -> tuple[torch.Tensor, dict]:
        """(final hidden states, fusion_loss_from_hidden's dict) with `replacement` (N, dim) in place of the
        embeddings at the N positions where `replace` (B, T) is true (Transfusion's latent patches), `ignore_id`'s
        targets left out. One method, so FSDP2 gathers the embedding, final norm and head around all their uses
        (families register it with `register_fsdp_forward_method`, as `loss`)."""
        embeds = self.embed(input_ids)
        if replace is not None:
            embeds = embeds.masked_scatter(replace[..., None], replacement.to(embeds.dtype))
        hidden = self.forward_hidden(input_ids, position_ids, document_ids, inputs_embeds=embeds,
                                     visible_from=visible_from)
        out = fusion_loss_from_hidden(
            hidden, self.head.weight, input_ids, document_ids, image_offset=self.config.image_offset,
            image_codes=self.config.image_codes, z_loss_coef=self.config.z_loss_coef, text_weight=text_weight,
            image_weight=image_weight, chunk_size=chunk_size, ignore_id=ignore_id,
        )
        return hidden, out

    # ---- utilities ------------------------------------------------------------------------------
    def new_kv_cache(self, batch_size: int, max_len: int | None = None, device: torch.device | str | None = None,
                     dtype: torch.dtype | None = None) -> KVCache:
        """An empty KVCache sized for this model (device/dtype default to the model's)."""
        p = self.embed.weight
        c = self.config
        return KVCache(c.n_layers, batch_size, c.kv_heads, max_len or c.max_seq_len, c.head_dim,
                       device=device or p.device, dtype=dtype or p.dtype)

    def num_parameters(self) -> int:
        """Number of parameters (equals config.num_parameters())."""
        return sum(p.numel() for p in self.parameters())
