"""The U-Net patch encoder/decoder of the Transfusion family (Zhou et al. 2024, arXiv 2408.11039, section 3 and
Table 7): `--model.family_options '{"patch_encoder": "unet"}'`, the alternative to `LatentPatches`' linear layers.

The decoder still sees one vector per k x k latent patch, in the family's order (row-major patches). At the input,
each image's patch vectors are unpatchified to its (C, h, w) latent grid and run through the down path: a 3x3
input convolution, then per resolution `blocks` ResNet blocks (group norm, SiLU, 3x3 convolutions, the timestep
embedding inside each block as a scale and shift of its second group norm, a residual connection), a downsampling convolution (kernel = stride = f) between
resolutions, where the factors f multiply to k (k's prime factors: 2 x 2 for k = 4, none for k = 1), and a 1x1
convolution to the decoder's width; its (dim, h/k, w/k) output is one vector per patch. At the output, the decoder's
vectors at the patches go back up: a 1x1 convolution from the decoder's width, per resolution (coarsest first) the
down path's activations at that resolution concatenated (the skip connection) and `blocks` ResNet blocks, a
nearest-neighbour upsampling and 3x3 convolution between resolutions, and group norm, SiLU and a 3x3 convolution to
the C latent channels: the predicted noise, patchified back to (P, C*k*k). Channels: `channels` x 2^level.

Skip connections: the up path needs the down path's activations of the same images at the same step. `embed` keeps
them (and the images' timestep embeddings) on the module, and the next call of the module (`forward`, the family's
`predict` calls them in that order within one decoder forward: training, `denoise` and the sampler alike) takes
them and clears them; a `forward` without its `embed`, or with other positions than `embed` had, is refused. They
are ordinary activations of the autograd graph, so the backward reaches the down path through them.

Images must be whole: `embed` reads its (P_total, C*k*k) patches as consecutive images of P = (h/k)(w/k) patches
each (the latent shards' packing keeps an image in one row: `data_shards.plan.whole_images`). An image's step is
the step of its first patch.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from tokenizer.layout import patchify, unpatchify


def prime_factors(n: int) -> list[int]:
    """n's prime factors, smallest first (none for 1): the down path's per-resolution downsampling factors."""
    factors, p = [], 2
    while n > 1:
        while n % p == 0:
            factors.append(p)
            n //= p
        p += 1
    return factors


def group_norm(channels: int) -> nn.GroupNorm:
    """Group norm with the most groups (at most 32) of at least 4 channels each that divide `channels` (one group
    when it has fewer than 8). Groups of one channel would cancel every per-channel constant, so a bias before
    them (an upsampling convolution's) would get no gradient."""
    groups = max(g for g in range(1, min(32, channels // 4) + 1) if channels % g == 0) if channels >= 8 else 1
    return nn.GroupNorm(groups, channels)


class ResBlock(nn.Module):
    """GN, SiLU, 3x3 conv, GN modulated by the step's embedding (a per-channel scale and shift, ADM's AdaGN: a
    plain added bias would be cancelled by the group norm after it), SiLU, 3x3 conv; plus the input (1x1 conv when
    the width changes)."""

    def __init__(self, in_channels: int, out_channels: int, time_dim: int) -> None:
        super().__init__()
        self.norm1 = group_norm(in_channels)
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, padding=1)
        self.time = nn.Linear(time_dim, 2 * out_channels)
        self.norm2 = group_norm(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1)
        self.shortcut = nn.Conv2d(in_channels, out_channels, 1) if in_channels != out_channels else nn.Identity()

    def forward(self, x: torch.Tensor, time: torch.Tensor) -> torch.Tensor:
        """x (N, in, H, W), time (N, time_dim) -> (N, out, H, W)."""
        h = self.conv1(F.silu(self.norm1(x)))
        scale, shift = self.time(F.silu(time))[:, :, None, None].chunk(2, dim=1)
        h = self.conv2(F.silu(self.norm2(h) * (1 + scale) + shift))
        return self.shortcut(x) + h


class UNetPatches(nn.Module):
    """`LatentPatches`' interface (`embed(noisy, t)` at the input, `forward(hidden)` at the output,
    `matmul_parameters()`) through U-Net down and up blocks. See the module docstring.

    latent_channels, patch_size, latent_grid: C, k and the (h, w) latent grid of every image; dim: the decoder's
    width; init_std: the decoder's init std; time: a module mapping (N,) steps to (N, time_dim) (the family's
    `TimestepEmbedding`); channels: the ResNet blocks' width at the latent grid's resolution (x 2 per
    downsampling); blocks: ResNet blocks per resolution on each path."""

    def __init__(self, latent_channels: int, patch_size: int, latent_grid: tuple[int, int], dim: int, init_std: float,
                 time: nn.Module, time_dim: int, channels: int = 64, blocks: int = 2) -> None:
        super().__init__()
        height, width = latent_grid
        k = patch_size
        if height % k or width % k:
            raise ValueError(f"the U-Net patch encoder needs a latent grid {height}x{width} that patch_size {k} "
                             "divides")
        self.latent_channels, self.patch_size, self.latent_grid, self.dim = latent_channels, k, (height, width), dim
        self.init_std = init_std
        self.factors = prime_factors(k)
        widths = [channels * 2 ** level for level in range(len(self.factors) + 1)]
        self.widths = widths
        self.time = time  # (N,) steps -> (N, time_dim): the family's TimestepEmbedding
        self.conv_in = nn.Conv2d(latent_channels, widths[0], 3, padding=1)
        self.down = nn.ModuleList(nn.ModuleList(ResBlock(w, w, time_dim) for _ in range(blocks)) for w in widths)
        self.downsample = nn.ModuleList(nn.Conv2d(widths[i], widths[i + 1], f, stride=f)
                                        for i, f in enumerate(self.factors))
        self.to_dim = nn.Conv2d(widths[-1], dim, 1)
        self.from_dim = nn.Conv2d(dim, widths[-1], 1)
        self.up = nn.ModuleList(nn.ModuleList(ResBlock(2 * w if b == 0 else w, w, time_dim) for b in range(blocks))
                                for w in widths)
        self.upsample = nn.ModuleList(nn.Conv2d(widths[i + 1], widths[i], 3, padding=1)
                                      for i in range(len(self.factors)))
        self.norm_out = group_norm(widths[0])
        self.conv_out = nn.Conv2d(widths[0], latent_channels, 3, padding=1)
        self._pending: tuple[list[torch.Tensor], torch.Tensor, int] | None = None
        self.reset_parameters()

    @property
    def patches_per_image(self) -> int:
        """P = (h/k)(w/k)."""
        height, width = self.latent_grid
        return (height // self.patch_size) * (width // self.patch_size)

    def reset_parameters(self) -> None:
        """Normal(0, init_std) for the linear layers and the 1x1 convolutions to and from the decoder's width (the
        decoder's init, as `LatentPatches`), torch's default for the other convolutions, zero biases."""
        for module in self.modules():
            if isinstance(module, nn.Linear) or module in (self.to_dim, self.from_dim):
                nn.init.normal_(module.weight, std=self.init_std)
                nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Conv2d):
                module.reset_parameters()
                nn.init.zeros_(module.bias)

    def _images(self, rows: int, what: str) -> int:
        per = self.patches_per_image
        if rows % per:
            raise ValueError(f"the U-Net patch encoder got {rows} patch {what}, not whole images of {per} patches "
                             f"(a {self.latent_grid[0]}x{self.latent_grid[1]} latent grid, patch_size "
                             f"{self.patch_size}): an image must not be cut")
        return rows // per

    def embed(self, noisy: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """(P_total, C*k*k) noisy patches of whole images at steps (P_total,) -> (P_total, dim) decoder inputs, one
        per patch in the same order; keeps the skip activations for the next `forward`."""
        n = self._images(noisy.shape[0], "vectors")
        per, k = self.patches_per_image, self.patch_size
        dtype = self.conv_in.weight.dtype
        x = unpatchify(noisy.to(dtype).reshape(n, per, noisy.shape[-1]), k, *self.latent_grid)
        time = self.time(t.reshape(n, per)[:, 0])  # an image's step: its first patch's
        h = self.conv_in(x)
        skips = []
        for level, level_blocks in enumerate(self.down):
            for block in level_blocks:
                h = block(h, time)
            skips.append(h)
            if level < len(self.factors):
                h = self.downsample[level](h)
        self._pending = (skips, time, n)
        h = self.to_dim(h)  # (n, dim, h/k, w/k)
        return h.permute(0, 2, 3, 1).reshape(n * per, self.dim)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """(P_total, dim) final hidden states at the patches `embed` was given -> (P_total, C*k*k) predicted noise."""
        if self._pending is None:
            raise RuntimeError("UNetPatches.forward needs the skip activations of an embed call of the same decoder "
                               "forward first (TransfusionFamily.predict calls embed, then forward)")
        skips, time, n = self._pending
        self._pending = None
        if hidden.shape[0] != n * self.patches_per_image:
            raise RuntimeError(f"UNetPatches.forward got {hidden.shape[0]} positions, its embed call "
                               f"{n * self.patches_per_image}")
        k = self.patch_size
        rows, cols = self.latent_grid[0] // k, self.latent_grid[1] // k
        h = hidden.to(self.from_dim.weight.dtype).reshape(n, rows, cols, self.dim).permute(0, 3, 1, 2)
        h = self.from_dim(h)
        for level in reversed(range(len(self.up))):
            h = torch.cat([h, skips[level]], dim=1)
            for block in self.up[level]:
                h = block(h, time)
            if level > 0:
                h = F.interpolate(h, scale_factor=self.factors[level - 1], mode="nearest")
                h = self.upsample[level - 1](h)
        out = self.conv_out(F.silu(self.norm_out(h)))  # (n, C, h, w)
        return patchify(out, k).reshape(n * self.patches_per_image, self.latent_channels * k * k)

    def matmul_parameters(self) -> float:
        """Weights a patch runs through in matrix products, each counted as often as it is applied per patch
        position (a convolution at a resolution with r x r latent cells per patch is applied r^2 times per patch),
        so that 6 x this is the training FLOPs per patch. The timestep MLP and the blocks' step projections run
        once per image but are counted once per patch: an upper bound, as `LatentPatches` counts."""
        k = self.patch_size
        cells = [(k // math.prod(self.factors[:level])) ** 2 for level in range(len(self.widths))]
        total = float(sum(p.numel() for p in self.time.parameters() if p.dim() >= 2))

        def convs(module: nn.Module, applied: int) -> float:
            count = 0.0
            for sub in module.modules():
                if isinstance(sub, nn.Conv2d):
                    count += sub.weight.numel() * applied
                elif isinstance(sub, nn.Linear):
                    count += sub.weight.numel()
            return count

        total += convs(self.conv_in, cells[0]) + convs(self.conv_out, cells[0])
        for level in range(len(self.widths)):
            total += convs(self.down[level], cells[level]) + convs(self.up[level], cells[level])
        for i in range(len(self.factors)):
            total += convs(self.downsample[i], cells[i + 1]) + convs(self.upsample[i], cells[i])
        return total + convs(self.to_dim, 1) + convs(self.from_dim, 1)


__all__ = ["ResBlock", "UNetPatches", "prime_factors"]
