"""VQGAN encoder and decoder in the layout of transformers' ChameleonVQVAE (encoder) and the original
VQGAN (decoder): res-blocks with GroupNorm + swish, stride-2 asymmetric downsampling, a mid attention block."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenizer.image.config import ImageTokenizerConfig


def _norm(channels: int, groups: int) -> nn.GroupNorm:
    return nn.GroupNorm(num_groups=groups, num_channels=channels, eps=1e-6, affine=True)


class ResnetBlock(nn.Module):
    """norm-swish-conv twice, plus a 1x1 shortcut when the width changes."""

    def __init__(self, in_channels: int, out_channels: int, groups: int, dropout: float = 0.0):
        super().__init__()
        self.norm1 = _norm(in_channels, groups)
        self.conv1 = nn.Conv2d(in_channels, out_channels, kernel_size=3, padding=1)
        self.norm2 = _norm(out_channels, groups)
        self.dropout = nn.Dropout(dropout)
        self.conv2 = nn.Conv2d(out_channels, out_channels, kernel_size=3, padding=1)
        # name kept from VQGAN/transformers so weights load by name
        self.nin_shortcut = (
            nn.Conv2d(in_channels, out_channels, kernel_size=1) if in_channels != out_channels else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Residual update of a (B, C, H, W) feature map."""
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(self.dropout(F.silu(self.norm2(h))))
        shortcut = x if self.nin_shortcut is None else self.nin_shortcut(x)
        return shortcut + h


class AttnBlock(nn.Module):
    """Single-head self-attention over all positions of a feature map (1x1-conv projections)."""

    def __init__(self, channels: int, groups: int):
        super().__init__()
        self.norm = _norm(channels, groups)
        self.q = nn.Conv2d(channels, channels, kernel_size=1)
        self.k = nn.Conv2d(channels, channels, kernel_size=1)
        self.v = nn.Conv2d(channels, channels, kernel_size=1)
        self.proj_out = nn.Conv2d(channels, channels, kernel_size=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Residual attention; SDPA's default 1/sqrt(C) scale is VQGAN's."""
        b, c, h, w = x.shape
        normed = self.norm(x)
        q, k, v = (
            proj(normed).reshape(b, 1, c, h * w).transpose(-1, -2) for proj in (self.q, self.k, self.v)
        )
        out = F.scaled_dot_product_attention(q, k, v)  # (b, 1, hw, c)
        return x + self.proj_out(out.transpose(-1, -2).reshape(b, c, h, w))


class Downsample(nn.Module):
    """Stride-2 3x3 conv after padding one pixel on the right and bottom only (torch has no asymmetric padding);
    or, `strided`, a 4x4 stride-2 conv with one pixel of padding on every side."""

    def __init__(self, channels: int, out_channels: int | None = None, strided: bool = False):
        super().__init__()
        out_channels = out_channels or channels
        self.strided = strided
        if strided:
            self.conv = nn.Conv2d(channels, out_channels, kernel_size=4, stride=2, padding=1)
        else:
            self.conv = nn.Conv2d(channels, out_channels, kernel_size=3, stride=2, padding=0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Halve H and W."""
        return self.conv(x if self.strided else F.pad(x, (0, 1, 0, 1)))


class Upsample(nn.Module):
    """Nearest-neighbour x2 then a 3x3 conv; or, `strided`, a 4x4 stride-2 transposed conv (computed at the input's
    resolution, a quarter of the work)."""

    def __init__(self, channels: int, out_channels: int | None = None, strided: bool = False):
        super().__init__()
        out_channels = out_channels or channels
        self.strided = strided
        if strided:
            self.conv = nn.ConvTranspose2d(channels, out_channels, kernel_size=4, stride=2, padding=1)
        else:
            self.conv = nn.Conv2d(channels, out_channels, kernel_size=3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Double H and W."""
        return self.conv(x if self.strided else F.interpolate(x, scale_factor=2.0, mode="nearest"))


class Level(nn.Module):
    """One resolution level: res-blocks (each optionally followed by attention) and a resampler."""

    def __init__(self, block: list[nn.Module], attn: list[nn.Module], resample: nn.Module | None, name: str):
        super().__init__()
        self.block = nn.ModuleList(block)
        self.attn = nn.ModuleList(attn)
        # registered as "downsample" / "upsample", the names in the reference state dicts
        self.resample_name = name if resample is not None else None
        if resample is not None:
            self.add_module(name, resample)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Blocks, attention after each block when present, then resampling."""
        for i, block in enumerate(self.block):
            x = block(x)
            if len(self.attn) > 0:
                x = self.attn[i](x)
        return x if self.resample_name is None else getattr(self, self.resample_name)(x)


class MidBlock(nn.Module):
    """res-block, attention, res-block at the lowest resolution."""

    def __init__(self, channels: int, groups: int, dropout: float):
        super().__init__()
        self.block_1 = ResnetBlock(channels, channels, groups, dropout)
        self.attn_1 = AttnBlock(channels, groups)
        self.block_2 = ResnetBlock(channels, channels, groups, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Mid block of the U-shaped VQGAN."""
        return self.block_2(self.attn_1(self.block_1(x)))


class Encoder(nn.Module):
    """Pixels (B, 3, H, W) -> latents (B, latent_channels, H/f, W/f), f = 2**(levels-1)."""

    def __init__(self, config: ImageTokenizerConfig):
        super().__init__()
        c, g = config, config.norm_groups
        self.conv_in = nn.Conv2d(c.in_channels, c.base_channels, kernel_size=3, padding=1)
        in_mult = (1, *c.channel_multiplier)
        resolution = c.image_size
        levels = []
        for i, mult in enumerate(c.channel_multiplier):
            width_in, width = c.base_channels * in_mult[i], c.base_channels * mult
            blocks, attns = [], []
            for j in range(c.encoder_blocks[i]):
                blocks.append(ResnetBlock(width_in if j == 0 else width, width, g, c.dropout))
                if resolution in c.attn_resolutions:
                    attns.append(AttnBlock(width, g))
            last = i == len(c.channel_multiplier) - 1
            # a level without blocks changes width in its downsampling conv
            down = None if last else Downsample(width if blocks else width_in, width, c.resample == "strided")
            levels.append(Level(blocks, attns, down, "downsample"))
            resolution = resolution if last else resolution // 2
        self.down = nn.ModuleList(levels)
        width = c.base_channels * c.channel_multiplier[-1]
        self.mid = MidBlock(width, g, c.dropout)
        self.norm_out = _norm(width, g)
        self.conv_out = nn.Conv2d(width, c.latent_channels, kernel_size=3, padding=1)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """Encode pixels in [-1, 1] to continuous latents (before quant_conv)."""
        h = self.conv_in(pixels)
        for level in self.down:
            h = level(h)
        h = self.mid(h)
        return self.conv_out(F.silu(self.norm_out(h)))


class Decoder(nn.Module):
    """Latents (B, latent_channels, h, w) -> pixels (B, 3, h*f, w*f), the mirror of `Encoder` (VQGAN's)."""

    def __init__(self, config: ImageTokenizerConfig):
        super().__init__()
        c, g = config, config.norm_groups
        mults = c.channel_multiplier
        width = c.base_channels * mults[-1]
        self.conv_in = nn.Conv2d(c.latent_channels, width, kernel_size=3, padding=1)
        self.mid = MidBlock(width, g, c.dropout)
        resolution = c.image_size // c.downsample_factor
        levels: list[Level] = []
        blocks_per_level = c.decoder_blocks
        for i in reversed(range(len(mults))):  # built lowest resolution first, stored as up[0] = highest
            width_out = c.base_channels * mults[i]
            blocks, attns = [], []
            for j in range(blocks_per_level[i]):
                blocks.append(ResnetBlock(width if j == 0 else width_out, width_out, g, c.dropout))
                if resolution in c.attn_resolutions:
                    attns.append(AttnBlock(width_out, g))
            width = width_out if blocks else width
            up = None
            if i > 0:
                # the upsampling conv keeps the width (VQGAN), or sets the next level's when that has no blocks
                target = width_out if blocks_per_level[i - 1] else c.base_channels * mults[i - 1]
                up, width = Upsample(width, target, c.resample == "strided"), target
            levels.insert(0, Level(blocks, attns, up, "upsample"))
            resolution = resolution * 2 if i > 0 else resolution
        self.up = nn.ModuleList(levels)
        self.norm_out = _norm(width, g)
        self.conv_out = nn.Conv2d(width, c.in_channels, kernel_size=3, padding=1)

    def forward(self, latents: torch.Tensor) -> torch.Tensor:
        """Decode latents (after post_quant_conv) to unbounded pixels; clamp only for display."""
        h = self.mid(self.conv_in(latents))
        for level in reversed(self.up):
            h = level(h)
        return self.conv_out(F.silu(self.norm_out(h)))

    @property
    def last_layer(self) -> torch.Tensor:
        """Weight of the final conv (the adaptive GAN weight balances gradients there)."""
        return self.conv_out.weight
