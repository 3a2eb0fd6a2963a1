"""`ContinuousImageTokenizer`: images <-> continuous latents (B, C, H/f, W/f) through a diagonal Gaussian (latent
diffusion's KL-VAE, the image tokenizer of Transfusion), with the VQ tokenizer's encoder, decoder and bundle."""

from __future__ import annotations

from typing import Any, ClassVar, NamedTuple

import torch
from torch import nn

from tokenizer.image.config import ImageTokenizerConfig
from tokenizer.image.image_tokenizer import ImageAutoencoder
from tokenizer.image.losses import gaussian_kl
from tokenizer.image.model import Decoder, Encoder

# LDM's clamp on the log-variance: exp() stays finite in fp32 and a variance driven to zero cannot reach -inf
LOGVAR_RANGE = (-30.0, 20.0)


class ContinuousOutput(NamedTuple):
    """What `ContinuousImageTokenizer.forward` returns (latents unscaled: `latent_scale` is for `encode` only)."""

    reconstruction: torch.Tensor  # (B, 3, H, W), unbounded: clamp only for display
    latents: torch.Tensor  # (B, C, h, w) the decoder read: a reparameterised sample when sampling, else the mean
    mean: torch.Tensor  # (B, C, h, w) posterior mean
    logvar: torch.Tensor  # (B, C, h, w) posterior log-variance, clamped to LOGVAR_RANGE
    kl: torch.Tensor  # (B,) KL from N(0, 1) in nats per image


class ContinuousImageTokenizer(ImageAutoencoder):
    """encoder -> quant_conv (mean and log-variance) -> sample -> post_quant_conv -> decoder; `encode` gives the
    posterior mean times `latent_scale`, `decode` inverts the scale."""

    kind: ClassVar[str] = "continuous"
    bottleneck: ClassVar[str] = "kl"

    def __init__(self, config: ImageTokenizerConfig):
        super().__init__()
        self._check_bottleneck(config)
        self.config = config
        self.encoder = Encoder(config)
        self.quant_conv = nn.Conv2d(config.latent_channels, 2 * config.embed_dim, kernel_size=1)
        self.post_quant_conv = nn.Conv2d(config.embed_dim, config.latent_channels, kernel_size=1)
        self.decoder = Decoder(config)
        # 1 / std of the posterior means on training data (Stable Diffusion's scaling factor), so that `encode`'s
        # latents have about unit variance for a diffusion model; set by ImageTokenizerModule while training and
        # measured again at the end of fit. A buffer: checkpoints, bundles and the fingerprint carry it.
        self.register_buffer("latent_scale", torch.ones(()))

    @property
    def latent_channels(self) -> int:
        """Channels of a latent (config.embed_dim; config.latent_channels is the encoder's width before quant_conv)."""
        return int(self.config.embed_dim)

    # ----- differentiable pieces (used in training) -----

    def posterior(self, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean and clamped log-variance (each (B, C, h, w)) of the Gaussian for pixels in [-1, 1]."""
        mean, logvar = self.quant_conv(self.encoder(pixels)).chunk(2, dim=1)
        return mean, logvar.clamp(*LOGVAR_RANGE)

    def decode_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """Pixels (unbounded) from unscaled latents (B, C, h, w)."""
        return self.decoder(self.post_quant_conv(latents))

    def forward(self, pixels: torch.Tensor, sample: bool | None = None) -> ContinuousOutput:
        """Reconstruct pixels through the Gaussian: a reparameterised sample (default in training mode) or the mean."""
        mean, logvar = self.posterior(pixels)
        latents = mean
        if self.training if sample is None else sample:
            latents = mean + torch.randn_like(mean) * (0.5 * logvar).exp()
        return ContinuousOutput(self.decode_latents(latents), latents, mean, logvar, gaussian_kl(mean, logvar))

    # ----- inference API -----

    @torch.no_grad()
    def encode(self, images: Any, batch_size: int = 32) -> torch.Tensor:
        """Latents (B, C, h, w), float32, deterministic (posterior mean x latent_scale) for PIL images, paths, bytes,
        or a float tensor (B, 3, H, W) in [-1, 1]."""
        pixels = self._to_pixels(images)
        dtype = self.quant_conv.weight.dtype
        chunks = [
            self.posterior(pixels[start : start + batch_size].to(self.device, dtype))[0].float()
            * self.latent_scale.float()
            for start in range(0, pixels.shape[0], batch_size)
        ]
        if not chunks:
            grid = self.latent_grid(tuple(pixels.shape[-2:])) if pixels.dim() == 4 else self.grid_shape
            return torch.empty(0, self.latent_channels, *grid, device=self.device)
        return torch.cat(chunks)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, batch_size: int = 32) -> torch.Tensor:
        """Pixels (B, 3, H, W), float32, clamped to [-1, 1], for latents (B, C, h, w) or (C, h, w) as `encode` gives
        them (any float dtype: float16 from token shards is fine)."""
        latents = self.check_latents(latents)
        dtype = self.quant_conv.weight.dtype
        unscaled = latents.to(self.device, torch.float32) / self.latent_scale.float()
        chunks = [
            self.decode_latents(unscaled[i : i + batch_size].to(dtype)).clamp(-1, 1).float()
            for i in range(0, unscaled.shape[0], batch_size)
        ]
        if not chunks:
            f = self.downsample_factor
            return torch.empty(0, self.config.in_channels, latents.shape[2] * f, latents.shape[3] * f,
                               device=self.device)
        return torch.cat(chunks)

    def check_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """`latents` as a (B, C, h, w) tensor; raises ValueError in one sentence on a dtype, shape or value that no
        latent of this tokenizer has."""
        latents = torch.as_tensor(latents)
        channels = self.latent_channels
        if not latents.dtype.is_floating_point:
            raise ValueError(
                f"latents must be a float tensor (B, {channels}, h, w), got dtype {latents.dtype}: integer codes "
                "belong to a VQ image tokenizer (kind 'vq'), not this continuous one"
            )
        given = tuple(latents.shape)
        if latents.dim() == 3:
            latents = latents.unsqueeze(0)
        if latents.dim() != 4 or latents.shape[1] != channels or min(latents.shape[2:]) < 1:
            raise ValueError(
                f"latents must have shape (B, {channels}, h, w) or ({channels}, h, w) with h, w >= 1 (this "
                f"tokenizer's {channels} channels), got {given}"
            )
        if latents.numel() and not bool(torch.isfinite(latents).all()):
            raise ValueError(f"latents of shape {tuple(latents.shape)} hold NaN or infinite values")
        return latents
