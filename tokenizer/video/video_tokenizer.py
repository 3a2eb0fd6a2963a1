"""`VideoTokenizer`: clips <-> (t, h, w) grids of codes with Emu3's temporal compression (4 frames -> 1 latent
frame); images are clips of one frame repeated. Bundles are config json + safetensors, as image tokenizers';
transformers' `Emu3VQVAE` weights import (every key but the codebook's is the same)."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar, NamedTuple

import numpy as np
import torch
from PIL import Image
from safetensors.torch import load_file
from torch import nn

from tokenizer.image.image_tokenizer import CONFIG_NAME, WEIGHTS_NAME, bundle_fingerprint, save_bundle
from tokenizer.image.preprocess import ImageSource, load_batch, preprocess, to_pil
from tokenizer.image.quantizer import Quantizer
from tokenizer.video.config import VideoTokenizerConfig, is_video_config
from tokenizer.video.model import CausalConv3d, Decoder, Encoder

TRANSFORMERS_CODEBOOK = "quantize.embedding.weight"  # Emu3VQVAE's codebook; ours is the project's EMA quantizer's


class VideoTokenizerOutput(NamedTuple):
    """What `VideoTokenizer.forward` returns."""

    reconstruction: torch.Tensor  # (B, T, 3, H, W), unbounded: clamp only for display
    codes: torch.LongTensor  # (B, t, h, w)
    vq_loss: torch.Tensor  # commitment loss (0 in eval mode)
    latents: torch.Tensor  # (B, embed_dim, t, h, w) before quantisation


def read_video_bundle_config(directory: str | os.PathLike) -> VideoTokenizerConfig:
    """The config of the video bundle in `directory`; raises naming a missing file or an image bundle."""
    directory = Path(directory)
    for path in (directory / CONFIG_NAME, directory / WEIGHTS_NAME):
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} is missing: a video tokenizer bundle needs {CONFIG_NAME} and {WEIGHTS_NAME} "
                "(write one with save_pretrained or `train.py tokenizer fit` on a video- preset)"
            )
    data = json.loads((directory / CONFIG_NAME).read_text())
    if not is_video_config(data):
        raise ValueError(
            f"{directory} is an image tokenizer bundle, not a video one; load it with "
            "tokenizer.image.load_image_tokenizer (tokenizer.bundle.load_media_tokenizer loads either kind), or pass a bundle "
            "trained with a video- preset"
        )
    return VideoTokenizerConfig.from_dict(data)


class VideoTokenizer(nn.Module):
    """Emu3-layout VQ-VAE: encoder -> quant_conv -> quantize -> post_quant_conv -> decoder (module names as
    transformers' `Emu3VQVAE`), with the project's quantizer (EMA codebook, straight-through estimator)."""

    kind: ClassVar[str] = "video"

    def __init__(self, config: VideoTokenizerConfig):
        super().__init__()
        self.config = config
        self.encoder = Encoder(config)
        self.decoder = Decoder(config)
        self.quantize = Quantizer(config)  # reads the quantizer fields only (codebook size, mode, EMA, ...)
        self.quant_conv = CausalConv3d(config.latent_channels, config.embed_dim, (3, 1, 1))
        self.post_quant_conv = CausalConv3d(config.embed_dim, config.latent_channels, (3, 1, 1))

    # ----- shapes -----

    @property
    def temporal_factor(self) -> int:
        """Input frames per latent frame (4 for Emu3)."""
        return self.config.temporal_downsample_factor

    @property
    def downsample_factor(self) -> int:
        """Pixels per code along each side."""
        return self.config.downsample_factor

    @property
    def grid_shape(self) -> tuple[int, int]:
        """(rows, columns) of codes per latent frame at `config.image_size`: what an image becomes."""
        return self.config.grid_shape

    @property
    def video_grid(self) -> tuple[int, int, int]:
        """(latent frames, rows, columns) of codes for a `config.clip_frames` clip at `config.image_size`."""
        return self.config.video_grid

    def latent_grid(self, image_size: int | tuple[int, int] | None = None) -> tuple[int, int]:
        """(rows, columns) of codes per latent frame for a square side or (height, width); default
        `config.image_size`."""
        size = self.config.image_size if image_size is None else image_size
        height, width = (size, size) if isinstance(size, int) else size
        f = self.downsample_factor
        if height <= 0 or width <= 0 or height % f or width % f:
            raise ValueError(f"frame size {height}x{width} must be a positive multiple of the downsampling factor {f}")
        return height // f, width // f

    def clip_grid(self, frames: int | None = None,
                  image_size: int | tuple[int, int] | None = None) -> tuple[int, int, int]:
        """(latent frames, rows, columns) of codes for a clip of `frames` frames (default `config.clip_frames`)."""
        frames = self.config.clip_frames if frames is None else frames
        if frames <= 0 or frames % self.temporal_factor:
            raise ValueError(f"a clip's frame count must be a positive multiple of the temporal factor "
                             f"{self.temporal_factor}, got {frames}")
        return (frames // self.temporal_factor, *self.latent_grid(image_size))

    @property
    def device(self) -> torch.device:
        """Device of the weights."""
        return self.quant_conv.conv.weight.device

    # ----- differentiable pieces (used in training) -----

    def encode_latents(self, clips: torch.Tensor) -> torch.Tensor:
        """Pre-quantisation latents (B, embed_dim, T/temporal_factor, h, w) of clips (B, T, 3, H, W) in [-1, 1]."""
        return self.quant_conv(self.encoder(clips))

    def quantize_latents(self, latents: torch.Tensor) -> tuple[torch.Tensor, torch.LongTensor, torch.Tensor]:
        """(quantized (B, D, t, h, w), codes (B, t, h, w), commitment loss) through the project's quantizer
        (which takes (B, D, rows, columns): the latent frames are stacked as rows)."""
        b, d, t, h, w = latents.shape
        quantized, codes, loss = self.quantize(latents.reshape(b, d, t * h, w))
        return quantized.reshape(b, d, t, h, w), codes.reshape(b, t, h, w), loss

    def decode_latents(self, quantized: torch.Tensor) -> torch.Tensor:
        """Frames (B, t*temporal_factor, 3, H, W), unbounded, from code vectors (B, embed_dim, t, h, w)."""
        return self.decoder(self.post_quant_conv(quantized), quantized)

    def forward(self, clips: torch.Tensor) -> VideoTokenizerOutput:
        """Reconstruct clips (B, T, 3, H, W) through the quantizer (straight-through gradients reach the encoder)."""
        self._check_clip_tensor(clips)
        latents = self.encode_latents(clips)
        quantized, codes, vq_loss = self.quantize_latents(latents)
        return VideoTokenizerOutput(self.decode_latents(quantized), codes, vq_loss, latents)

    # ----- input checks -----

    def _check_pixels(self, pixels: torch.Tensor, what: str) -> None:
        if not pixels.dtype.is_floating_point:
            raise ValueError(
                f"{what} tensors must be float in [-1, 1], got dtype {pixels.dtype}; "
                "pass uint8 data as PIL images / paths (images) or numpy arrays (clips)"
            )
        if pixels.numel() and (pixels.min() < -1.001 or pixels.max() > 1.001):
            raise ValueError(
                f"{what} tensors must lie in [-1, 1], got [{float(pixels.min()):.3f}, {float(pixels.max()):.3f}]"
            )
        f = self.downsample_factor
        if pixels.shape[-1] % f or pixels.shape[-2] % f:
            raise ValueError(f"height and width must be multiples of {f}, got {tuple(pixels.shape[-2:])}")

    def _check_clip_tensor(self, clips: torch.Tensor) -> None:
        if clips.dim() != 5 or clips.shape[2] != self.config.in_channels:
            raise ValueError(
                f"clips must be a (B, T, {self.config.in_channels}, H, W) tensor, got shape {tuple(clips.shape)}"
                " (images go through encode)"
            )
        frames = clips.shape[1]
        if frames == 0 or frames % self.temporal_factor:
            raise ValueError(
                f"a clip's frame count must be a positive multiple of the temporal factor {self.temporal_factor} "
                f"(each latent frame covers {self.temporal_factor} frames), got {frames} frames; "
                "trim or pad the clip"
            )

    def _images_to_pixels(self, images: Any) -> torch.Tensor:
        if isinstance(images, torch.Tensor):
            pixels = images.unsqueeze(0) if images.dim() == 3 else images
            if pixels.dim() != 4 or pixels.shape[1] != self.config.in_channels:
                raise ValueError(f"expected a (B, 3, H, W) or (3, H, W) tensor, got shape {tuple(images.shape)}")
            self._check_pixels(pixels, "pixel")
            return pixels
        single = isinstance(images, str | os.PathLike | bytes | Image.Image)
        sources: Sequence[ImageSource] = [images] if single else list(images)
        return load_batch(sources, self.config.image_size).pixels

    def _clips_to_pixels(self, clips: Any) -> torch.Tensor:
        if isinstance(clips, torch.Tensor):
            self._check_clip_tensor(clips)
            self._check_pixels(clips, "clip")
            return clips
        if isinstance(clips, np.ndarray):  # one clip (T, H, W, 3), or a batch of equal ones (B, T, H, W, 3)
            clips = list(clips) if clips.ndim == 5 else [clips]
        arrays = list(clips)
        tensors = []
        for i, clip in enumerate(arrays):
            clip = np.asarray(clip)
            if clip.dtype != np.uint8 or clip.ndim != 4 or clip.shape[-1] != 3:
                raise ValueError(
                    f"clip {i}: numpy clips must be uint8 (T, H, W, 3), got {clip.dtype} {tuple(clip.shape)}; "
                    "pass float tensors (B, T, 3, H, W) in [-1, 1] otherwise"
                )
            if len(clip) == 0 or len(clip) % self.temporal_factor:
                raise ValueError(
                    f"clip {i}: a clip's frame count must be a positive multiple of the temporal factor "
                    f"{self.temporal_factor}, got {len(clip)} frames; trim or pad the clip"
                )
            tensors.append(clip_to_tensor(clip, self.config.image_size))
        if not tensors:
            return torch.empty(0, self.temporal_factor, 3, self.config.image_size, self.config.image_size)
        return torch.stack(tensors)

    @contextlib.contextmanager
    def _evaluating(self) -> Iterator[None]:
        """Eval mode (BatchNorm's running statistics, no EMA codebook updates) for the duration, then as before:
        a sample's codes never depend on the rest of its batch."""
        was_training = self.training
        self.eval()
        try:
            yield
        finally:
            self.train(was_training)

    # ----- inference API -----

    @torch.no_grad()
    def encode_clips(self, clips: Any, batch_size: int = 8) -> torch.LongTensor:
        """Codes (B, T/temporal_factor, h, w) for a float tensor (B, T, 3, H, W) in [-1, 1] or uint8 numpy clips
        (T, H, W, 3) (one, a list, or a (B, T, H, W, 3) array; resized and center-cropped to `config.image_size` as
        images are)."""
        pixels = self._clips_to_pixels(clips)
        dtype = self.quant_conv.conv.weight.dtype
        codes = []
        with self._evaluating():
            for start in range(0, pixels.shape[0], batch_size):
                latents = self.encode_latents(pixels[start : start + batch_size].to(self.device, dtype))
                codes.append(self.quantize_latents(latents)[1])
        if not codes:
            t = pixels.shape[1] // self.temporal_factor
            f = self.downsample_factor
            return torch.empty(0, t, pixels.shape[-2] // f, pixels.shape[-1] // f, dtype=torch.long,
                               device=self.device)
        return torch.cat(codes)

    @torch.no_grad()
    def encode(self, images: Any, batch_size: int = 32) -> torch.LongTensor:
        """Codes (B, h, w) for PIL images, paths, bytes, or a float tensor (B, 3, H, W) in [-1, 1]; each image is
        encoded as a clip of its frame repeated `temporal_factor` times (Emu3's rule)."""
        pixels = self._images_to_pixels(images)
        clips = pixels.unsqueeze(1).expand(-1, self.temporal_factor, -1, -1, -1)
        return self.encode_clips(clips, batch_size)[:, 0]

    def codes_to_latents(self, codes: torch.Tensor) -> torch.Tensor:
        """Code vectors (B, D, t, h, w) for codes (B, t, h, w); raises on codes outside the codebook."""
        b, t, h, w = codes.shape
        vectors = self.quantize.codes_to_latents(codes.reshape(b, t * h, w))
        return vectors.reshape(b, -1, t, h, w)

    @torch.no_grad()
    def decode_clips(self, codes: torch.Tensor, batch_size: int = 8) -> torch.Tensor:
        """Frames (B, t*temporal_factor, 3, H, W) clamped to [-1, 1] for codes (B, t, h, w) or (t, h, w)."""
        codes = torch.as_tensor(codes)
        if codes.dim() == 3:
            codes = codes.unsqueeze(0)
        if codes.dim() != 4 or 0 in codes.shape[1:]:
            raise ValueError(f"clip codes must have shape (B, t, h, w) or (t, h, w), got {tuple(codes.shape)}")
        latents = self.codes_to_latents(codes.to(self.device))
        with self._evaluating():
            chunks = [self.decode_latents(latents[i : i + batch_size]).clamp(-1, 1)
                      for i in range(0, latents.shape[0], batch_size)]
        if chunks:
            return torch.cat(chunks)
        t, h, w = codes.shape[1:]
        f = self.downsample_factor
        return latents.new_empty(0, t * self.temporal_factor, self.config.out_channels, h * f, w * f)

    @torch.no_grad()
    def decode(self, codes: torch.Tensor, batch_size: int = 32) -> torch.Tensor:
        """Pixels (B, 3, H, W) clamped to [-1, 1] for image codes (B, h, w) or (h, w): the first decoded frame."""
        codes = torch.as_tensor(codes)
        if codes.dim() == 2:
            codes = codes.unsqueeze(0)
        if codes.dim() != 3:
            raise ValueError(f"image codes must have shape (B, h, w) or (h, w), got {tuple(codes.shape)}")
        return self.decode_clips(codes.unsqueeze(1), batch_size)[:, 0]

    to_pil = staticmethod(to_pil)

    # ----- identity and persistence -----

    def fingerprint(self) -> str:
        """SHA-256 (first 16 hex digits) over the config and every weight and buffer (codebook, BatchNorm stats)."""
        return bundle_fingerprint(self)

    def save_pretrained(self, directory: str | os.PathLike) -> Path:
        """Write config.json + model.safetensors into `directory` (each atomically)."""
        return save_bundle(self, directory)

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike,
                        map_location: str | torch.device = "cpu") -> VideoTokenizer:
        """Load a bundle written by `save_pretrained` (safetensors, no pickle), in eval mode."""
        model = cls(read_video_bundle_config(directory))
        state = load_file(str(Path(directory) / WEIGHTS_NAME), device=str(map_location))
        model.load_state_dict(state, strict=True)
        return model.to(map_location).eval()

    # ----- transformers -----

    def _codebook_state(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.state_dict().items() if k.startswith("quantize.")}

    def transformers_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights under transformers' `Emu3VQVAE` names: ours, with the codebook as `quantize.embedding.weight`
        (load it with `Emu3VQVAE.load_state_dict(..., strict=True)`; Euclidean codes only)."""
        if self.config.quantizer != "chameleon":
            raise ValueError("only Euclidean codebooks (quantizer 'chameleon') have an Emu3VQVAE equivalent")
        state = {k: v for k, v in self.state_dict().items() if not k.startswith("quantize.")}
        state[TRANSFORMERS_CODEBOOK] = self.quantize.codebook.detach().clone()
        return state

    @classmethod
    def from_transformers(cls, vqvae: nn.Module, **overrides: Any) -> VideoTokenizer:
        """Import a transformers `Emu3VQVAE`: every weight and BatchNorm statistic loads under its own name; the
        codebook becomes the EMA quantizer's (as if every code had been seen once). `overrides` set the
        training-side fields (image_size, clip_frames, ...)."""
        config = VideoTokenizerConfig.from_transformers(vqvae.config, **overrides)
        model = cls(config)
        source = dict(vqvae.state_dict())
        if TRANSFORMERS_CODEBOOK not in source:
            raise ValueError(f"{type(vqvae).__name__} has no {TRANSFORMERS_CODEBOOK}; is it an Emu3VQVAE?")
        codebook = source.pop(TRANSFORMERS_CODEBOOK)
        result = model.load_state_dict({**model._codebook_state(), **source}, strict=False)
        if result.missing_keys or result.unexpected_keys:
            raise ValueError(
                f"Emu3VQVAE weights do not match this layout: missing {result.missing_keys[:5]}, unexpected "
                f"{result.unexpected_keys[:5]}; the configs disagree"
            )
        with torch.no_grad():
            model.quantize.vq.codebook = codebook.to(model.quantize.codebook)
            book = model.quantize.vq._codebook
            book.embed_avg.copy_(book.embed)  # a consistent EMA state with cluster_size = 1
            book.cluster_size.fill_(1.0)
            book.initted.fill_(True)
        return model.eval()


def clip_to_tensor(frames: np.ndarray, size: int) -> torch.Tensor:
    """uint8 frames (T, H, W, 3) -> float (T, 3, size, size) in [-1, 1], each frame as an image is preprocessed
    (shortest side resized to `size`, center crop); frames already of that size are only rescaled."""
    if frames.shape[1] == size and frames.shape[2] == size:
        pixels = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2).double() / 255.0 * 2 - 1
        return pixels.float()
    return torch.stack([preprocess(Image.fromarray(frame), size) for frame in frames])
