"""Emu3's VQ-VAE networks, with transformers' module names (so its state dict loads as is): a 2-D encoder run on
every frame followed by causal temporal downsampling, and a decoder that upsamples time causally before a 2-D decoder
whose norms are conditioned on the code vectors (SpatialNorm).

Tensors between the temporal layers are (B, C, T, H, W). Temporal convolutions pad time on the left only (by 2,
Emu3's fixed amount), so output frame t never reads input frames after the ones it covers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenizer.video.config import VideoTokenizerConfig


def _group_norm(config: VideoTokenizerConfig, channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(num_groups=config.norm_groups, num_channels=channels, eps=1e-6, affine=True)


class CausalConv3d(nn.Module):
    """Conv3d whose time axis is padded by 2 frames on the left (none on the right); space is padded to keep
    its size at stride 1 (odd kernels)."""

    TIME_PAD = 2

    def __init__(self, in_channels: int, out_channels: int, kernel_size: tuple[int, int, int],
                 stride: tuple[int, int, int] = (1, 1, 1)):
        super().__init__()
        pad: list[int] = []
        for k, s in reversed(list(zip(kernel_size[1:], stride[1:]))):  # F.pad lists the last axis first
            extra = k - s
            pad += [extra - extra // 2, extra // 2]
        self.padding = (*pad, self.TIME_PAD, 0)
        self.conv = nn.Conv3d(in_channels, out_channels, kernel_size, stride=stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, T, H, W) -> (B, C', T', H, W)."""
        return self.conv(F.pad(x, self.padding))


class TemporalDownsample(nn.Module):
    """Halve time: kernel (4, 3, 3), stride (2, 1, 1), causal."""

    def __init__(self, in_channels: int, out_channels: int):
        super().__init__()
        self.conv = CausalConv3d(in_channels, out_channels, (4, 3, 3), (2, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, T, H, W) -> (B, C, T/2, H, W)."""
        return self.conv(x)


class TemporalUpsample(nn.Module):
    """Double time (each frame repeated, i.e. nearest), then a causal (3, 3, 3) convolution."""

    def __init__(self, in_channels: int, out_channels: int):
        super().__init__()
        self.conv = CausalConv3d(in_channels, out_channels, (3, 3, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, T, H, W) -> (B, C, 2T, H, W)."""
        return self.conv(x.repeat_interleave(2, dim=2))


class TemporalResnetBlock(nn.Module):
    """BatchNorm -> SiLU -> causal conv, twice, plus the input (BatchNorm: batch statistics in training mode)."""

    def __init__(self, in_channels: int, out_channels: int | None = None):
        super().__init__()
        out_channels = in_channels if out_channels is None else out_channels
        self.norm1 = nn.BatchNorm3d(in_channels)
        self.conv1 = CausalConv3d(in_channels, out_channels, (3, 3, 3))
        self.norm2 = nn.BatchNorm3d(out_channels)
        self.conv2 = CausalConv3d(out_channels, out_channels, (3, 3, 3))
        self.nin_shortcut = nn.Conv3d(in_channels, out_channels, 1) if in_channels != out_channels else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, T, H, W) -> (B, C', T, H, W)."""
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        return (x if self.nin_shortcut is None else self.nin_shortcut(x)) + h


class SpatialNorm(nn.Module):
    """GroupNorm whose scale and shift come from the code vectors (resized to the features, nearest)."""

    def __init__(self, config: VideoTokenizerConfig, quant_channels: int, channels: int):
        super().__init__()
        self.norm_layer = _group_norm(config, channels)
        self.conv_y = nn.Conv2d(quant_channels, channels, 1)
        self.conv_b = nn.Conv2d(quant_channels, channels, 1)

    def forward(self, x: torch.Tensor, quant: torch.Tensor) -> torch.Tensor:
        """Normalise x (N, C, H, W), conditioned on quant (N, D, h, w)."""
        quant = F.interpolate(quant, size=x.shape[-2:], mode="nearest")
        return self.norm_layer(x) * self.conv_y(quant) + self.conv_b(quant)


def _norm(config: VideoTokenizerConfig, channels: int, quant_channels: int | None) -> nn.Module:
    """GroupNorm (encoder) or SpatialNorm (decoder), called as norm(x) or norm(x, quant) by `_apply_norm`."""
    return SpatialNorm(config, quant_channels, channels) if quant_channels is not None else _group_norm(config, channels)


def _apply_norm(norm: nn.Module, x: torch.Tensor, quant: torch.Tensor | None) -> torch.Tensor:
    return norm(x, quant) if isinstance(norm, SpatialNorm) else norm(x)


class ResnetBlock(nn.Module):
    """2-D res-block: norm -> SiLU -> 3x3 conv, twice, plus the (1x1-projected) input."""

    def __init__(self, config: VideoTokenizerConfig, in_channels: int, out_channels: int | None = None,
                 quant_channels: int | None = None):
        super().__init__()
        out_channels = in_channels if out_channels is None else out_channels
        self.norm1 = _norm(config, in_channels, quant_channels)
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, padding=1)
        self.norm2 = _norm(config, out_channels, quant_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1)
        self.nin_shortcut = nn.Conv2d(in_channels, out_channels, 1) if in_channels != out_channels else None

    def forward(self, x: torch.Tensor, quant: torch.Tensor | None = None) -> torch.Tensor:
        """(N, C, H, W) -> (N, C', H, W)."""
        h = self.conv1(F.silu(_apply_norm(self.norm1, x, quant)))
        h = self.conv2(F.silu(_apply_norm(self.norm2, h, quant)))
        return (x if self.nin_shortcut is None else self.nin_shortcut(x)) + h


class AttentionBlock(nn.Module):
    """Multi-head self-attention over the positions of one frame (q, k, v and output projections)."""

    def __init__(self, config: VideoTokenizerConfig):
        super().__init__()
        width = config.hidden_size
        self.heads = config.num_attention_heads
        self.dropout = config.attention_dropout
        self.q_proj = nn.Linear(width, width)
        self.k_proj = nn.Linear(width, width)
        self.v_proj = nn.Linear(width, width)
        self.out_proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(N, L, C) -> (N, L, C)."""
        n, length, _ = x.shape

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.view(n, length, self.heads, -1).transpose(1, 2)

        out = F.scaled_dot_product_attention(split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x)),
                                             dropout_p=self.dropout if self.training else 0.0)
        return self.out_proj(out.transpose(1, 2).reshape(n, length, -1))


def _attend(attn: AttentionBlock, norm: nn.Module, x: torch.Tensor, quant: torch.Tensor | None) -> torch.Tensor:
    """x + attention over the H*W positions of the normalised x (N, C, H, W)."""
    n, c, h, w = x.shape
    tokens = _apply_norm(norm, x, quant).flatten(2).transpose(1, 2)
    return x + attn(tokens).transpose(1, 2).reshape(n, c, h, w)


class MiddleBlock(nn.Module):
    """Res-block, attention, res-block at the lowest resolution."""

    def __init__(self, config: VideoTokenizerConfig, channels: int, quant_channels: int | None = None):
        super().__init__()
        self.block_1 = ResnetBlock(config, channels, channels, quant_channels)
        self.attn_1 = AttentionBlock(config)
        self.attn_norm = _norm(config, channels, quant_channels)
        self.block_2 = ResnetBlock(config, channels, channels, quant_channels)

    def forward(self, x: torch.Tensor, quant: torch.Tensor | None = None) -> torch.Tensor:
        """(N, C, h, w) -> (N, C, h, w)."""
        x = self.block_1(x, quant)
        x = _attend(self.attn_1, self.attn_norm, x, quant)
        return self.block_2(x, quant)


class Downsample(nn.Module):
    """3x3 stride-2 conv after padding one pixel on the right and bottom (VQGAN's)."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(N, C, H, W) -> (N, C, H/2, W/2)."""
        return self.conv(F.pad(x, (0, 1, 0, 1)))


class Upsample(nn.Module):
    """Nearest x2 then a 3x3 conv."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(N, C, H, W) -> (N, C, 2H, 2W)."""
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


def _level(config: VideoTokenizerConfig, widths: list[tuple[int, int]], attention: bool,
           quant_channels: int | None) -> nn.Module:
    """One resolution level: `block` (res-blocks), `attn` and `attn_norms` (one each per block, or empty)."""
    level = nn.Module()
    level.block = nn.ModuleList(ResnetBlock(config, cin, cout, quant_channels) for cin, cout in widths)
    level.attn = nn.ModuleList(AttentionBlock(config) for _ in widths) if attention else nn.ModuleList()
    level.attn_norms = (nn.ModuleList(_norm(config, cout, quant_channels) for _, cout in widths)
                        if attention else nn.ModuleList())
    return level


def _run_level(level: nn.Module, x: torch.Tensor, quant: torch.Tensor | None) -> torch.Tensor:
    for i, block in enumerate(level.block):
        x = block(x, quant)
        if len(level.attn):
            x = _attend(level.attn[i], level.attn_norms[i], x, quant)
    return x


class DownBlock(nn.Module):
    """The encoder's levels, highest resolution first (`down[i]`, each but the last with a `downsample`)."""

    def __init__(self, config: VideoTokenizerConfig):
        super().__init__()
        mults = (1, *config.channel_multiplier)
        self.down = nn.ModuleList()
        for i in range(config.levels):
            cin, cout = config.base_channels * mults[i], config.base_channels * mults[i + 1]
            widths = [(cin if j == 0 else cout, cout) for j in range(config.num_res_blocks)]
            level = _level(config, widths, i in config.attn_resolutions, None)
            if i != config.levels - 1:
                level.downsample = Downsample(cout)
            self.down.append(level)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(N, base, H, W) -> (N, top width, H/f, W/f)."""
        for level in self.down:
            x = _run_level(level, x, None)
            if hasattr(level, "downsample"):
                x = level.downsample(x)
        return x


class UpBlock(nn.Module):
    """The decoder's levels, stored highest resolution first (`up[i]`, each but the first with an `upsample`) and
    run lowest resolution first; every norm is a SpatialNorm on the code vectors."""

    def __init__(self, config: VideoTokenizerConfig):
        super().__init__()
        quant_channels = config.embed_dim
        levels: list[nn.Module] = []
        cin = config.base_channels * config.channel_multiplier[-1]
        for i in reversed(range(config.levels)):
            cout = config.base_channels * config.channel_multiplier[i]
            widths = [(cin if j == 0 else cout, cout) for j in range(config.num_res_blocks + 1)]
            level = _level(config, widths, i in config.attn_resolutions, quant_channels)
            if i != 0:
                level.upsample = Upsample(cout)
            levels.insert(0, level)
            cin = cout
        self.up = nn.ModuleList(levels)

    def forward(self, x: torch.Tensor, quant: torch.Tensor) -> torch.Tensor:
        """(N, top width, h, w) -> (N, base, h*f, w*f)."""
        for level in reversed(self.up):
            x = _run_level(level, x, quant)
            if hasattr(level, "upsample"):
                x = level.upsample(x)
        return x


class Encoder(nn.Module):
    """Frames (B, T, 3, H, W) -> latents (B, latent_channels, T/temporal_factor, H/f, W/f)."""

    def __init__(self, config: VideoTokenizerConfig):
        super().__init__()
        top = config.base_channels * config.channel_multiplier[-1]
        latent = config.latent_channels
        self.conv_in = nn.Conv2d(config.in_channels, config.base_channels, 3, padding=1)
        self.down_block = DownBlock(config)
        self.middle_block = MiddleBlock(config, top)
        self.norm_out = _group_norm(config, top)
        self.conv_out = nn.Conv2d(top, latent, 3, padding=1)
        self.time_conv = nn.ModuleList(TemporalDownsample(latent, latent) for _ in range(config.temporal_blocks))
        self.time_res_stack = nn.ModuleList(TemporalResnetBlock(latent, latent) for _ in range(config.num_res_blocks))

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        """Each frame through the 2-D encoder, then the causal temporal layers."""
        b, t = frames.shape[:2]
        x = self.conv_in(frames.flatten(0, 1))
        x = self.middle_block(self.down_block(x))
        x = self.conv_out(F.silu(self.norm_out(x)))
        x = x.unflatten(0, (b, t)).transpose(1, 2)  # (B, C, T, h, w)
        for conv in self.time_conv:
            x = F.silu(conv(x))
        for block in self.time_res_stack:
            x = block(x)
        return x


class Decoder(nn.Module):
    """Post-quant latents and code vectors (B, C, t, h, w) -> frames (B, t*temporal_factor, 3, H, W)."""

    def __init__(self, config: VideoTokenizerConfig):
        super().__init__()
        top = config.base_channels * config.channel_multiplier[-1]
        latent, quant_channels = config.latent_channels, config.embed_dim
        self.time_res_stack = nn.ModuleList(TemporalResnetBlock(latent, latent) for _ in range(config.num_res_blocks))
        self.time_conv = nn.ModuleList(TemporalUpsample(latent, latent) for _ in range(config.temporal_blocks))
        self.conv_in = nn.Conv2d(latent, top, 3, padding=1)
        self.middle_block = MiddleBlock(config, top, quant_channels)
        self.up_block = UpBlock(config)
        self.norm_out = SpatialNorm(config, quant_channels, config.base_channels * config.channel_multiplier[0])
        self.conv_out = nn.Conv2d(config.base_channels * config.channel_multiplier[0], config.out_channels, 3,
                                  padding=1)

    @property
    def last_layer(self) -> torch.Tensor:
        """The output convolution's weight (what an adaptive GAN weight would read)."""
        return self.conv_out.weight

    def forward(self, latents: torch.Tensor, quant: torch.Tensor) -> torch.Tensor:
        """Upsample time for both inputs with the same layers (one batch, as Emu3 does), then decode each frame."""
        b = latents.shape[0]
        x = torch.cat([latents, quant])
        for block in self.time_res_stack:
            x = block(x)
        for conv in self.time_conv:
            x = F.silu(conv(x))
        x = x.transpose(1, 2)  # (2B, T, C, h, w)
        frames = x.shape[1]
        latents, quant = x[:b].flatten(0, 1), x[b:].flatten(0, 1)
        h = self.middle_block(self.conv_in(latents), quant)
        h = self.up_block(h, quant)
        h = self.conv_out(F.silu(self.norm_out(h, quant)))
        return h.unflatten(0, (b, frames))
