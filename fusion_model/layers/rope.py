"""Rotary position embeddings (the rotate_half convention of LLaMA and Chameleon)."""

from __future__ import annotations

import torch


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
