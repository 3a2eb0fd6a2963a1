"""The image tokenizer's configuration: one dataclass and named presets (chameleon, demo-64, photos-64, scenes-64,
small-128; kl-demo-64, kl-scenes-64 and kl-f8 for the continuous tokenizer)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

QUANTIZER_MODES = ("chameleon", "improved")
RESAMPLE_MODES = ("vqgan", "strided")
# "vq": a codebook, images become integer codes (Chameleon); "kl": a diagonal Gaussian, images become continuous
# latents (the VAE of latent diffusion and Transfusion)
BOTTLENECKS = ("vq", "kl")
# Fields added after bundles and shards were first written: left out of `to_dict` at their defaults, so the
# fingerprints of existing tokenizers do not change.
_LATER_FIELDS: dict[str, Any] = {"decoder_res_blocks": None, "resample": "vqgan", "bottleneck": "vq"}


@dataclass
class ImageTokenizerConfig:
    """Sizes of the VQGAN (transformers' ChameleonVQVAEConfig names) and of its quantizer."""

    image_size: int = 512  # square side the preprocessing produces
    in_channels: int = 3
    base_channels: int = 128
    channel_multiplier: tuple[int, ...] = (1, 1, 2, 2, 4)  # one entry per level; 2**(levels-1) downsampling
    # res-blocks per encoder level: one count for all levels (Chameleon's layout), or one per level; a level with
    # none changes width in its stride-2 conv instead (cheap high-resolution levels for small CPU presets)
    num_res_blocks: int | tuple[int, ...] = 2
    # res-blocks per decoder level (highest resolution first); None is VQGAN's num_res_blocks + 1 at every level
    decoder_res_blocks: int | tuple[int, ...] | None = None
    # "vqgan": 3x3 stride-2 conv down, nearest x2 + 3x3 conv up (Chameleon); "strided": 4x4 stride-2 conv down and
    # 4x4 stride-2 transposed conv up (the VQ-VAE paper's), which computes at the lower resolution: ~4x cheaper
    resample: str = "vqgan"
    attn_resolutions: tuple[
        int, ...
    ] = ()  # feature-map sides that get attention (the mid block always has one)
    latent_channels: int = 256  # encoder output channels before quant_conv
    dropout: float = 0.0
    norm_groups: int = 32  # GroupNorm groups; Chameleon uses 32, tiny presets fewer
    codebook_size: int = 8192
    quantizer: str = (
        "chameleon"  # "chameleon": Euclidean argmin; "improved": LlamaGen-style l2-normalised codes
    )
    # None means "the quantizer mode's default" (resolved in __post_init__):
    # code dimension: latent_channels (chameleon) or 8 (improved); with bottleneck "kl", the latent channels
    embed_dim: int | None = None
    kmeans_init: bool | None = None  # False (chameleon) / True (improved)
    dead_code_threshold: float | None = None  # EMA cluster size under which a code is replaced: 0 / 2
    commitment_weight: float = 0.25  # beta
    ema_decay: float = 0.99  # EMA codebook update (synchronised across DDP ranks)
    rotation_trick: bool = False  # False: plain straight-through estimator
    # "kl" replaces the quantizer by a Gaussian (quant_conv gives mean and log-variance of embed_dim channels); the
    # codebook fields above are then unused
    bottleneck: str = "vq"
    name: str = field(default="custom", compare=False)

    def __post_init__(self) -> None:
        if self.quantizer not in QUANTIZER_MODES:
            raise ValueError(f"quantizer must be one of {QUANTIZER_MODES}, got {self.quantizer!r}")
        if self.resample not in RESAMPLE_MODES:
            raise ValueError(f"resample must be one of {RESAMPLE_MODES}, got {self.resample!r}")
        if self.bottleneck not in BOTTLENECKS:
            raise ValueError(f"bottleneck must be one of {BOTTLENECKS}, got {self.bottleneck!r}")
        improved = self.quantizer == "improved"
        if self.embed_dim is None:
            self.embed_dim = 8 if improved else self.latent_channels
        if self.kmeans_init is None:
            self.kmeans_init = improved
        if self.dead_code_threshold is None:
            self.dead_code_threshold = 2.0 if improved else 0.0
        self.channel_multiplier = tuple(int(m) for m in self.channel_multiplier)
        self.attn_resolutions = tuple(int(r) for r in self.attn_resolutions)
        self.num_res_blocks = _per_level_or_int(self.num_res_blocks, "num_res_blocks", self.levels)
        if self.decoder_res_blocks is not None:
            self.decoder_res_blocks = _per_level_or_int(self.decoder_res_blocks, "decoder_res_blocks", self.levels)
        mults = self.channel_multiplier
        if self.encoder_blocks[-1] == 0 and (1, *mults)[-2] != mults[-1]:  # the encoder's level i reads (1, *mults)[i]
            raise ValueError(
                "the lowest encoder level changes width but has no res-block to do it "
                f"(channel_multiplier {self.channel_multiplier}, num_res_blocks {self.num_res_blocks})"
            )
        if self.image_size % self.downsample_factor:
            raise ValueError(
                f"image_size {self.image_size} must be divisible by the downsampling factor "
                f"{self.downsample_factor} (2**(len(channel_multiplier)-1))"
            )
        widths = {self.base_channels * m for m in self.channel_multiplier}
        if any(w % self.norm_groups for w in widths):
            raise ValueError(
                f"every level width {sorted(widths)} must be divisible by norm_groups={self.norm_groups}"
            )

    @property
    def levels(self) -> int:
        """Resolution levels (one per channel_multiplier entry)."""
        return len(self.channel_multiplier)

    @property
    def encoder_blocks(self) -> tuple[int, ...]:
        """Res-blocks of each encoder level, highest resolution first."""
        return self._per_level(self.num_res_blocks)

    @property
    def decoder_blocks(self) -> tuple[int, ...]:
        """Res-blocks of each decoder level, highest resolution first."""
        if self.decoder_res_blocks is None:
            return tuple(n + 1 for n in self.encoder_blocks)
        return self._per_level(self.decoder_res_blocks)

    def _per_level(self, blocks: int | tuple[int, ...]) -> tuple[int, ...]:
        return blocks if isinstance(blocks, tuple) else (blocks,) * self.levels

    @property
    def chameleon_layout(self) -> bool:
        """Whether transformers' ChameleonVQVAE can hold this encoder and quantizer (one block count, GroupNorm 32,
        Euclidean codes)."""
        return (self.bottleneck == "vq" and self.quantizer == "chameleon" and self.norm_groups == 32
                and isinstance(self.num_res_blocks, int)
                and self.num_res_blocks > 0 and self.resample == "vqgan")

    @property
    def downsample_factor(self) -> int:
        """Pixels per code along each side (16 for Chameleon)."""
        return 2 ** (len(self.channel_multiplier) - 1)

    @property
    def grid_shape(self) -> tuple[int, int]:
        """Codes per image (rows, columns) at `image_size`."""
        side = self.image_size // self.downsample_factor
        return side, side

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON form (tuples become lists)."""
        data = dataclasses.asdict(self)
        return {k: list(v) if isinstance(v, tuple) else v for k, v in data.items()
                if not (k in _LATER_FIELDS and v == _LATER_FIELDS[k])}

    def to_json(self) -> str:
        """Stable JSON text (sorted keys), also used by the fingerprint."""
        return json.dumps(self.to_dict(), sort_keys=True, indent=2)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ImageTokenizerConfig:
        """Build from `to_dict` output; unknown keys are an error naming them."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"unknown image tokenizer config keys {unknown}; valid keys: {sorted(names)}")
        return cls(**data)

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> ImageTokenizerConfig:
        """A named preset, optionally with some fields replaced (e.g. quantizer='improved')."""
        if name not in PRESETS:
            raise ValueError(f"unknown image tokenizer preset {name!r}; choose one of {sorted(PRESETS)}")
        data = {**PRESETS[name], **overrides}
        return cls.from_dict({"name": name, **data})


def _per_level_or_int(value: Any, name: str, levels: int) -> int | tuple[int, ...]:
    """An int, or a tuple with one non-negative int per level (lists from JSON/YAML become tuples)."""
    if isinstance(value, (list, tuple)):
        value = tuple(int(v) for v in value)
        if len(value) != levels or min(value) < 0:
            raise ValueError(f"{name} must be one count >= 0 or {levels} of them (one per level), got {list(value)}")
        return value
    if int(value) < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return int(value)


# MNIST-like digits at 64 px -> 4x4 codes; ~1.0M parameters, trains on a CPU in minutes. Chosen by measurement
# (docs/results/image_tokenizer.md): the work sits at the 4x4 and 8x8 levels, where it is cheap; the 64, 32 and 16 px
# levels only resample (4x4 stride-2 convs, as in the VQ-VAE paper), so a step costs a quarter of the VQGAN layout's
# and 3.5 CPU-minutes reach ~25 dB on digits instead of 19.5. Euclidean 32-d codes with k-means initialisation, and
# dead codes replaced only when unused for a few hundred steps (EMA hits per step below 0.05).
_DEMO_64: dict[str, Any] = dict(
    image_size=64,
    base_channels=8,
    channel_multiplier=(1, 2, 4, 8, 8),  # 5 levels: 16x downsampling, so 4x4 codes at 64 px
    num_res_blocks=(0, 0, 0, 1, 2),
    decoder_res_blocks=(0, 0, 0, 1, 2),
    resample="strided",
    latent_channels=32,
    norm_groups=8,
    codebook_size=512,
    quantizer="chameleon",
    kmeans_init=True,
    dead_code_threshold=0.05,
)

# The continuous tokenizer for the demo's digits: demo-64's encoder and decoder with a Gaussian of 8 channels (as
# Transfusion's VAE) in place of the codebook. The latent grid stays demo-64's 4x4 (16x downsampling), so a
# diffusion decoder reading 1x1 patches sees 16 patches per digit, as many as a Chameleon decoder sees codes.
# The codebook fields (codebook_size, k-means, dead codes) are left at their defaults, unused: a Gaussian has none.
_KL_DEMO_64: dict[str, Any] = {
    **{k: v for k, v in _DEMO_64.items() if k not in ("codebook_size", "quantizer", "kmeans_init", "dead_code_threshold")},
    "bottleneck": "kl",
    "embed_dim": 8,
}

# Transfusion-like continuous tokenizer for real images: latent diffusion's kl-f8 VAE (8x downsampling, 4 levels of
# widths 128-512, 2 res-blocks per level, attention only in the mid block, VQGAN resampling) with Transfusion's 8
# latent channels; the encoder's output is 2 x 8 wide, as LDM's (mean and log-variance of each channel), and 256 px
# give 32x32 latents, 16x16 = 256 patches of 2x2. ~84M parameters: a GPU preset.
_KL_F8: dict[str, Any] = {
    "image_size": 256,
    "base_channels": 128,
    "channel_multiplier": (1, 2, 4, 4),
    "num_res_blocks": 2,
    "latent_channels": 16,
    "bottleneck": "kl",
    "embed_dim": 8,
}

# photos at 64 px -> 8x8 codes (8 px per code): 16 codes cannot hold a photo (19.7 dB after 15 CPU-minutes at
# 4x4, under a flat mean colour's 20.0), 64 reach 21.3; one level fewer than demo-64, the same cheap top levels
_PHOTOS_64: dict[str, Any] = {**_DEMO_64, "channel_multiplier": (1, 2, 4, 8), "num_res_blocks": (0, 0, 0, 2),
                              "decoder_res_blocks": (0, 0, 0, 2)}

# The scene world (data_shards/scenes.py): photos-64's layout, 8x8 codes of 8 px, so an object of 16-24 px is at
# least 2x2 codes. An 8-px patch of a scene is black, one of 4 flat colours, or an edge of one of 3 shapes at some
# sub-code offset: a few hundred distinct patches at most, so 256 codes hold them with every code in use (a larger
# codebook leaves codes dead and spreads the decoder's image-code softmax over unused ids).
_SCENES_64: dict[str, Any] = {**_PHOTOS_64, "codebook_size": 256}

# The continuous tokenizer for the scene world (Transfusion): scenes-64's encoder and decoder with kl-demo-64's
# 8-channel Gaussian in place of the codebook; 8x8 latents (64 patches of 1x1, as many as scenes-64's codes).
_KL_SCENES_64: dict[str, Any] = {
    **{k: v for k, v in _PHOTOS_64.items() if k not in ("codebook_size", "quantizer", "kmeans_init",
                                                        "dead_code_threshold")},
    "bottleneck": "kl",
    "embed_dim": 8,
}

# Each preset names only the fields it changes (from the dataclass defaults, or from the preset it derives
# from); configs/tokenizer/*.yaml name a preset and add only their overrides.
PRESETS: dict[str, dict[str, Any]] = {
    # transformers' ChameleonVQVAEConfig defaults: 512 px -> 32x32 codes, codebook 8192 x 256.
    "chameleon": {},
    "demo-64": _DEMO_64,
    "photos-64": _PHOTOS_64,
    "scenes-64": _SCENES_64,
    # small photos at 128 px -> 8x8 codes, for CPU training runs on real photos: the demo-64 network
    # (convolutions do not grow with resolution, compute grows 4x) with a codebook twice as large.
    "small-128": {**_DEMO_64, "image_size": 128, "codebook_size": 1024},
    "kl-demo-64": _KL_DEMO_64,
    "kl-scenes-64": _KL_SCENES_64,
    "kl-f8": _KL_F8,
}
