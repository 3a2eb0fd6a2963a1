"""Vector quantizer: vector-quantize-pytorch's EMA codebook behind a (B, D, h, w) interface, in Chameleon's
mode (Euclidean argmin) or LlamaGen's (l2-normalised low-dimensional codes, k-means init, dead-code restarts)."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
from einops import rearrange
from torch import nn
from vector_quantize_pytorch import VectorQuantize
from vector_quantize_pytorch.vector_quantize_pytorch import (
    batched_sample_vectors,
    noop,
    sample_vectors_distributed,
)

from tokenizer.image.config import ImageTokenizerConfig


class QuantizerOutput(NamedTuple):
    """What `Quantizer.forward` returns."""

    quantized: torch.Tensor  # (B, D, h, w); straight-through (or rotation-trick) gradients to the input
    codes: torch.LongTensor  # (B, h, w)
    loss: torch.Tensor  # commitment loss times beta (0 in eval mode)


class Quantizer(nn.Module):
    """Nearest-code quantizer with an EMA-updated codebook (`vq` is vector-quantize-pytorch's module)."""

    def __init__(self, config: ImageTokenizerConfig):
        super().__init__()
        self.codebook_size = config.codebook_size
        self.embed_dim = config.embed_dim
        self.cosine = config.quantizer == "improved"
        self.vq = VectorQuantize(
            dim=config.embed_dim,
            codebook_size=config.codebook_size,
            decay=config.ema_decay,
            commitment_weight=config.commitment_weight,
            use_cosine_sim=self.cosine,
            kmeans_init=bool(config.kmeans_init),
            threshold_ema_dead_code=float(config.dead_code_threshold or 0.0),
            rotation_trick=config.rotation_trick,
            # Decided at construction time the library would read "not distributed" (Lightning builds the model
            # before the process group exists); `set_codebook_sync` switches it on in `setup`.
            sync_codebook=False,
            channel_last=True,
        )

    @property
    def codebook(self) -> torch.Tensor:
        """The (codebook_size, embed_dim) code vectors (l2-normalised in improved mode)."""
        return self.vq.codebook

    def forward(self, latents: torch.Tensor) -> QuantizerOutput:
        """Quantize (B, D, h, w) latents; in training mode this also updates the EMA codebook."""
        b, d, h, w = latents.shape
        if d != self.embed_dim:
            raise ValueError(
                f"quantizer expects {self.embed_dim} channels, got latents of shape {tuple(latents.shape)}"
            )
        # channel-last sequences rather than accept_image_fmap=True: in vector-quantize-pytorch 1.32 that path
        # returned wrong vectors from get_output_from_indices in one configuration
        flat = rearrange(latents, "b d h w -> b (h w) d")
        quantized, codes, loss = self.vq(flat)
        quantized = rearrange(quantized, "b (h w) d -> b d h w", h=h, w=w)
        return QuantizerOutput(quantized, codes.reshape(b, h, w), loss.sum())

    def codes_to_latents(self, codes: torch.Tensor) -> torch.Tensor:
        """Code vectors (B, D, h, w) for integer codes (B, h, w); raises on codes outside the codebook."""
        if codes.dtype.is_floating_point or codes.dtype == torch.bool:
            raise ValueError(f"codes must be an integer tensor, got dtype {codes.dtype}")
        if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= self.codebook_size):
            raise ValueError(
                f"codes must lie in [0, {self.codebook_size}); got values in [{int(codes.min())}, {int(codes.max())}]"
                " (were these ids from the unified vocabulary? subtract image_offset first)"
            )
        vectors = self.codebook[codes.long()]  # (B, h, w, D)
        return rearrange(vectors, "b h w d -> b d h w")


def set_codebook_sync(quantizer: Quantizer, enabled: bool | None = None) -> bool:
    """All-reduce EMA statistics, k-means init and dead-code samples across DDP ranks (default: if initialised).

    Every rank must then run the same number of training forwards: a rank that skips one leaves the others
    waiting in all_reduce forever (the library has no timeout of its own).
    """
    if enabled is None:
        enabled = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    book = quantizer.vq._codebook
    book.use_ddp = enabled
    book.all_reduce_fn = dist.all_reduce if enabled else noop
    book.kmeans_all_reduce_fn = dist.all_reduce if enabled else noop
    book.sample_fn = sample_vectors_distributed if enabled else batched_sample_vectors
    book.replace_sample_fn = sample_vectors_distributed if enabled else batched_sample_vectors
    return enabled


def codebook_stats(codes: torch.Tensor, codebook_size: int) -> dict[str, float]:
    """Usage (fraction of codes seen) and perplexity (exp of the code entropy) of a batch of codes."""
    counts = torch.bincount(codes.flatten().long(), minlength=codebook_size).double()
    return stats_from_counts(counts)


def stats_from_counts(counts: torch.Tensor) -> dict[str, float]:
    """Usage and perplexity from a histogram of code counts."""
    total = counts.sum()
    if total == 0:
        return {"usage": 0.0, "perplexity": 0.0, "codes_used": 0}
    p = counts / total
    entropy = -(p[p > 0] * p[p > 0].log()).sum()
    used = int((counts > 0).sum())
    return {"usage": used / counts.numel(), "perplexity": float(entropy.exp()), "codes_used": used}
