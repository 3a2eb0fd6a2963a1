"""What Transfusion adds around the decoder with the linear patch encoder: the timestep embedding, and the latent
patch projections in and out (the U-Net encoder is `unet.py`)."""

from __future__ import annotations

import math

import torch
from torch import nn

TIMESTEP_FREQUENCIES = 256  # width of the sinusoidal step features (DiT's)


class TimestepEmbedding(nn.Module):
    """The diffusion step as a vector: sinusoidal features (DiT's) through a two-layer MLP."""

    def __init__(self, dim: int, frequencies: int = TIMESTEP_FREQUENCIES) -> None:
        super().__init__()
        self.frequencies = frequencies
        self.mlp = nn.Sequential(nn.Linear(frequencies, dim), nn.SiLU(), nn.Linear(dim, dim))

    def features(self, t: torch.Tensor) -> torch.Tensor:
        """(N,) steps -> (N, frequencies): cos and sin of t at geometrically spaced frequencies 1 ... 1/10,000."""
        half = self.frequencies // 2
        scale = torch.exp(-math.log(10_000.0) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
        angles = t.float()[:, None] * scale
        return torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        """(N,) steps -> (N, dim)."""
        first = self.mlp[0]
        return self.mlp(self.features(t).to(first.weight.dtype))


class LatentPatches(nn.Module):
    """What Transfusion adds around the decoder: a patch's noisy latent into the decoder's width (plus its step's
    embedding) at the input, and the decoder's hidden state back to a predicted noise at the output."""

    def __init__(self, latent_dim: int, dim: int, init_std: float) -> None:
        super().__init__()
        self.init_std = init_std
        self.patch_in = nn.Linear(latent_dim, dim)
        self.time = TimestepEmbedding(dim)
        self.patch_out = nn.Linear(dim, latent_dim)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Normal(0, init_std) matrices (the decoder's init), zero biases."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=self.init_std)
                nn.init.zeros_(module.bias)

    def embed(self, noisy: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """(P, C*k*k) noisy patches at steps (P,) -> (P, dim) decoder inputs."""
        return self.patch_in(noisy.to(self.patch_in.weight.dtype)) + self.time(t)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """(P, dim) final hidden states at patch positions -> (P, C*k*k) predicted noise."""
        return self.patch_out(hidden)

    def matmul_parameters(self) -> int:
        """Weights a patch runs through in matrix products (FLOPs counting)."""
        return sum(p.numel() for p in self.parameters() if p.dim() >= 2)
