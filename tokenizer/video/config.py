"""The video tokenizer's configuration: transformers' `Emu3VQVAEConfig` fields plus the training-side ones (frame
size, clip length, the project's quantizer settings), and named presets (video-demo-32, emu3)."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

QUANTIZER_MODES = ("chameleon", "improved")
# the key that tells a video bundle's config.json from an image one (tokenizer.bundle.load_media_tokenizer dispatches on it)
VIDEO_CONFIG_KEY = "temporal_downsample_factor"


def is_video_config(data: dict[str, Any]) -> bool:
    """Whether a bundle's config.json (as a dict) describes a video tokenizer."""
    return VIDEO_CONFIG_KEY in data


def is_video_bundle(directory: str | os.PathLike) -> bool:
    """Whether the bundle in `directory` holds a video tokenizer (its config.json says so)."""
    config_path = Path(directory) / "config.json"
    return config_path.is_file() and is_video_config(json.loads(config_path.read_text()))


@dataclass
class VideoTokenizerConfig:
    """Emu3 VQ-VAE sizes (transformers' `Emu3VQVAEConfig` names) and the quantizer used to train it."""

    image_size: int = 512  # square side of training frames (and of images given to `encode`)
    clip_frames: int = 4  # frames per training clip; a multiple of temporal_downsample_factor
    codebook_size: int = 32768
    embed_dim: int = 4  # code vector size; Emu3's decoder runs its temporal layers on the code vectors too,
    latent_channels: int = 4  # so the two must be equal
    double_latent: bool = False  # Emu3 keeps it False; True (mean and variance channels) is not supported
    in_channels: int = 3
    out_channels: int = 3
    temporal_downsample_factor: int = 4  # frames per latent frame: log2 of it causal stride-2 Conv3d layers
    base_channels: int = 256
    channel_multiplier: tuple[int, ...] = (1, 2, 2, 4)  # one entry per level; 2**(levels-1) spatial downsampling
    num_res_blocks: int = 2  # per encoder level (decoder: one more), and the temporal res-blocks on each side
    attn_resolutions: tuple[int, ...] = (3,)  # level indices (Emu3's meaning, not pixel sides) with attention
    hidden_size: int | None = None  # attention width; None: the last level's width (it must equal it)
    num_attention_heads: int = 1
    attention_dropout: float = 0.0
    norm_groups: int = 32  # GroupNorm groups; transformers' Emu3 always has 32, tiny presets fewer
    # the project's quantizer (tokenizer.image.quantizer): EMA codebook, straight-through estimator
    quantizer: str = "chameleon"  # Euclidean argmin, Emu3's rule; "improved": l2-normalised codes
    kmeans_init: bool = False
    dead_code_threshold: float = 0.0
    commitment_weight: float = 0.25
    ema_decay: float = 0.99
    rotation_trick: bool = False
    name: str = field(default="custom", compare=False)

    def __post_init__(self) -> None:
        self.channel_multiplier = tuple(int(m) for m in self.channel_multiplier)
        self.attn_resolutions = tuple(int(r) for r in self.attn_resolutions)
        if self.hidden_size is None:
            self.hidden_size = self.base_channels * self.channel_multiplier[-1]
        if self.quantizer not in QUANTIZER_MODES:
            raise ValueError(f"quantizer must be one of {QUANTIZER_MODES}, got {self.quantizer!r}")
        if self.double_latent:
            raise ValueError("double_latent=True is not supported (Emu3's VQ-VAE uses False)")
        if self.embed_dim != self.latent_channels:
            raise ValueError(
                f"embed_dim ({self.embed_dim}) must equal latent_channels ({self.latent_channels}): Emu3's decoder "
                "runs the same temporal layers on the code vectors and on the post-quant latents"
            )
        factor = self.temporal_downsample_factor
        if factor < 1 or factor & (factor - 1):
            raise ValueError(f"temporal_downsample_factor must be a power of 2, got {factor}")
        if self.clip_frames < 1 or self.clip_frames % factor:
            raise ValueError(
                f"clip_frames ({self.clip_frames}) must be a positive multiple of temporal_downsample_factor ({factor})"
            )
        if self.image_size % self.downsample_factor:
            raise ValueError(
                f"image_size {self.image_size} must be divisible by the downsampling factor "
                f"{self.downsample_factor} (2**(len(channel_multiplier)-1))"
            )
        widths = {self.base_channels * m for m in (1, *self.channel_multiplier)}
        if any(w % self.norm_groups for w in widths):
            raise ValueError(f"every level width {sorted(widths)} must be divisible by norm_groups={self.norm_groups}")
        bad_levels = [r for r in self.attn_resolutions if not 0 <= r < self.levels]
        if bad_levels:
            raise ValueError(f"attn_resolutions are level indices below {self.levels}, got {bad_levels}")
        for level in (*self.attn_resolutions, self.levels - 1):  # the middle block's attention is at the last width
            width = self.base_channels * self.channel_multiplier[level]
            if width != self.hidden_size:
                raise ValueError(
                    f"hidden_size {self.hidden_size} must equal the width {width} of every level with attention "
                    f"(level {level}; the middle block's is the last level)"
                )
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by {self.num_attention_heads} heads")

    @property
    def levels(self) -> int:
        """Spatial resolution levels (one per channel_multiplier entry)."""
        return len(self.channel_multiplier)

    @property
    def downsample_factor(self) -> int:
        """Pixels per code along each side."""
        return 2 ** (self.levels - 1)

    @property
    def temporal_blocks(self) -> int:
        """Causal stride-2 temporal downsamples in the encoder (upsamples in the decoder)."""
        return self.temporal_downsample_factor.bit_length() - 1

    @property
    def grid_shape(self) -> tuple[int, int]:
        """Codes per latent frame (rows, columns) at `image_size`."""
        side = self.image_size // self.downsample_factor
        return side, side

    @property
    def video_grid(self) -> tuple[int, int, int]:
        """Codes (latent frames, rows, columns) of a `clip_frames` clip at `image_size`."""
        return (self.clip_frames // self.temporal_downsample_factor, *self.grid_shape)

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON form (tuples become lists)."""
        data = dataclasses.asdict(self)
        return {k: list(v) if isinstance(v, tuple) else v for k, v in data.items()}

    def to_json(self) -> str:
        """Stable JSON text (sorted keys), also used by the fingerprint."""
        return json.dumps(self.to_dict(), sort_keys=True, indent=2)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> VideoTokenizerConfig:
        """Build from `to_dict` output; unknown keys are an error naming them."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"unknown video tokenizer config keys {unknown}; valid keys: {sorted(names)}")
        return cls(**data)

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> VideoTokenizerConfig:
        """A named preset, optionally with some fields replaced."""
        if name not in VIDEO_PRESETS:
            raise ValueError(f"unknown video tokenizer preset {name!r}; choose one of {sorted(VIDEO_PRESETS)}")
        return cls.from_dict({"name": name, **VIDEO_PRESETS[name], **overrides})

    @classmethod
    def from_transformers(cls, hf_config: Any, **overrides: Any) -> VideoTokenizerConfig:
        """The config of a transformers `Emu3VQVAEConfig` (frame size and clip length from `overrides`)."""
        fields = ("codebook_size", "embed_dim", "latent_channels", "double_latent", "in_channels", "out_channels",
                  "temporal_downsample_factor", "base_channels", "channel_multiplier", "num_res_blocks",
                  "attn_resolutions", "hidden_size", "num_attention_heads", "attention_dropout")
        data = {name: getattr(hf_config, name) for name in fields}
        data["attn_resolutions"] = tuple(data["attn_resolutions"] or ())
        data["attention_dropout"] = float(data["attention_dropout"])
        factor = 2 ** (len(data["channel_multiplier"]) - 1)
        defaults = {"image_size": 64 * factor, "clip_frames": hf_config.temporal_downsample_factor,
                    "name": "emu3-import"}
        return cls(**{**data, **defaults, **overrides})


# Moving shapes at 32 px, 8-frame clips -> 2 x 8 x 8 = 128 codes per clip (64 per image); ~0.2M parameters, trains
# on 2 CPU cores in minutes. Emu3's layout at small widths (8, 16, 32 channels; GroupNorm of 4 groups): 3 levels (4x
# spatial), 1 res-block per level and on each temporal side, attention only in the middle blocks, 8-d codes (Emu3: 4)
# from a 512-entry codebook with k-means initialisation and dead-code restarts (as demo-64).
_VIDEO_DEMO_32: dict[str, Any] = dict(
    image_size=32,
    clip_frames=8,
    codebook_size=512,
    embed_dim=8,
    latent_channels=8,
    base_channels=8,
    channel_multiplier=(1, 2, 4),
    num_res_blocks=1,
    attn_resolutions=(),
    norm_groups=4,
    kmeans_init=True,
    dead_code_threshold=0.05,
)

VIDEO_PRESETS: dict[str, dict[str, Any]] = {
    # transformers' Emu3VQVAEConfig defaults: 512 px frames -> 64x64 codes per 4 frames, codebook 32768 x 4
    "emu3": {"image_size": 512, "clip_frames": 4},
    "video-demo-32": _VIDEO_DEMO_32,
}
