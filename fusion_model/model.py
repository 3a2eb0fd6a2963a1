"""The fused decoder: Chameleon's transformer (QK-norm, pre or swin norm, SwiGLU, RoPE) over packed rows."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from fusion_model.blocks import block_class
from fusion_model.config import FusionConfig
from fusion_model.layers import attention_backends as attn_lib
from fusion_model.layers import roles
from fusion_model.layers.attention import AttentionContext
from fusion_model.layers.kv_cache import KVCache
from fusion_model.layers.loss import fusion_loss_from_hidden
from fusion_model.layers.norms import QKNorm, RMSNorm
from fusion_model.layers.rope import rope_cos_sin
from tokenizer.layout import image_position_mask


def _one_document_per_row(document_ids: torch.Tensor) -> bool:
    """Whether every row is a single document without padding (reads the ids: a device sync on GPUs)."""
    return bool(((document_ids == document_ids[:, :1]) & (document_ids >= 0)).all())


def modality_groups(input_ids: torch.Tensor, config: FusionConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat indices into (B * T) of the text tokens and of the image tokens.

    Image = an image-code id or the config's continuous-image placeholder id (the one image-position rule,
    `tokenizer.layout.image_position_mask`); everything else, text specials and <boi>/<eoi> included, is text.
    """
    is_image = image_position_mask(input_ids, config.image_offset, config.image_codes,
                                   config.image_placeholder_id).reshape(-1)
    return (~is_image).nonzero().squeeze(1), is_image.nonzero().squeeze(1)


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
        to the identity. Roles as the modules declare them (`fusion_model.layers.roles`)."""
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
             chunk_size: int = 4096, target_mask: torch.Tensor | None = None) -> dict:
        """fusion_loss without materialising all logits: the head + CE run in checkpointed token chunks; only
        tokens where `target_mask` (B, T) bool is true are targets (None: every token)."""
        if document_ids is None:
            document_ids = torch.zeros_like(input_ids)
        hidden = self.forward_hidden(input_ids, position_ids, document_ids)
        return fusion_loss_from_hidden(
            hidden, self.head.weight, input_ids, document_ids,
            image_offset=self.config.image_offset, image_codes=self.config.image_codes,
            z_loss_coef=self.config.z_loss_coef, text_weight=text_weight, image_weight=image_weight,
            chunk_size=chunk_size, target_mask=target_mask,
        )

    def hidden_and_loss(self, input_ids: torch.Tensor, document_ids: torch.Tensor,
                        position_ids: torch.Tensor | None = None, *, replace: torch.Tensor | None = None,
                        replacement: torch.Tensor | None = None, visible_from: torch.Tensor | None = None,
                        ignore_id: int | None = None, text_weight: float = 1.0, image_weight: float = 1.0,
                        chunk_size: int = 4096,
                        target_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
        """(final hidden states, fusion_loss_from_hidden's dict) with `replacement` (N, dim) in place of the
        embeddings at the N positions where `replace` (B, T) is true (Transfusion's latent patches), `ignore_id`'s
        targets and the tokens `target_mask` leaves out not scored. One method, so FSDP2 gathers the embedding,
        final norm and head around all their uses (families register it with `register_fsdp_forward_method`, as
        `loss`)."""
        embeds = self.embed(input_ids)
        if replace is not None:
            embeds = embeds.masked_scatter(replace[..., None], replacement.to(embeds.dtype))
        hidden = self.forward_hidden(input_ids, position_ids, document_ids, inputs_embeds=embeds,
                                     visible_from=visible_from)
        out = fusion_loss_from_hidden(
            hidden, self.head.weight, input_ids, document_ids, image_offset=self.config.image_offset,
            image_codes=self.config.image_codes, z_loss_coef=self.config.z_loss_coef, text_weight=text_weight,
            image_weight=image_weight, chunk_size=chunk_size, ignore_id=ignore_id, target_mask=target_mask,
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
