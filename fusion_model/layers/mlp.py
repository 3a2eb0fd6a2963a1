"""The SwiGLU feed-forward (gate and up fused into one matmul)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fusion_model.layers import roles


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


class MLP(nn.Module):
    """SwiGLU feed-forward down(silu(gate(x)) * up(x)), gate and up fused into one matmul."""

    PARAMETER_ROLES = {"gate_up.weight": roles.MLP, "down.weight": roles.MLP_OUTPUT}

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.gate_up = nn.Linear(dim, 2 * hidden_dim, bias=False)
        self.down = nn.Linear(hidden_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, T, dim) -> (B, T, dim)."""
        return self.down(_SwiGLU.apply(self.gate_up(x)))
