"""TransfusionOptions: the transfusion family's `--model.family_options`, each checked when made."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True)
class TransfusionOptions:
    """`--model.family_options` of the transfusion family.

    latent_channels, patch_size: C and k of the latent patches (a patch vector holds C*k*k values);
    image_placeholder_id: the vocabulary's `<image>` id (fit takes these three from the shards / vocabulary);
    diffusion_weight: lambda, the diffusion term's weight against the text term;
    diffusion_steps: N of the cosine schedule; caption_dropout: the probability that an image is trained
    unconditionally; image_bidirectional: full attention inside each image (false: causal, the ablation);
    max_t_image_first: the largest step drawn for an image that opens its document and is followed by text
    (paper, Table 8: captioning sees less noisy images), None for no limit;
    patch_encoder: "linear" (a linear layer in and out, `LatentPatches`) or "unet" (U-Net down and up blocks with
    skip connections, `fusion_model.families.transfusion.unet`; paper, Table 7); latent_grid: [h, w] of every
    image's latents (the U-Net's grid; fit takes it from the shards when patch_encoder is "unet");
    unet_channels, unet_blocks: the U-Net's width at the latent resolution (doubling per downsampling) and ResNet
    blocks per resolution and path; x0_clip: sampling clamps each DDIM step's clean estimate to [-x0_clip, x0_clip]
    (the continuous tokenizer scales latents to unit std; null: no clamp), see `CosineSchedule.ddim_step`.
    """

    latent_channels: int | None = None
    patch_size: int = 2
    image_placeholder_id: int | None = None
    diffusion_weight: float = 5.0
    diffusion_steps: int = 1000
    caption_dropout: float = 0.1
    image_bidirectional: bool = True
    max_t_image_first: int | None = 500
    patch_encoder: str = "linear"
    latent_grid: tuple[int, int] | None = None
    unet_channels: int = 64
    unet_blocks: int = 2
    x0_clip: float | None = 4.0

    def __post_init__(self) -> None:
        def fail(name: str, rule: str) -> None:
            raise ValueError(f"model.family_options.{name}={getattr(self, name)!r} is invalid for the transfusion "
                             f"family: {rule}")

        def is_int(value: Any) -> bool:
            return isinstance(value, numbers.Integral) and not isinstance(value, bool)

        def is_real(value: Any) -> bool:
            return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)

        if self.latent_channels is not None and (not is_int(self.latent_channels) or self.latent_channels <= 0):
            fail("latent_channels", "it must be a positive integer")
        for name in ("patch_size", "diffusion_steps"):
            if not is_int(getattr(self, name)) or getattr(self, name) <= 0:
                fail(name, "it must be a positive integer")
        for name in ("image_placeholder_id", "max_t_image_first"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or value < 0):
                fail(name, "it must be an integer >= 0 or null")
        if not is_real(self.diffusion_weight) or self.diffusion_weight < 0:
            fail("diffusion_weight", "it must be a finite number >= 0")
        if not is_real(self.caption_dropout) or not 0 <= self.caption_dropout < 1:
            fail("caption_dropout", "it must be a number with 0 <= caption_dropout < 1")
        if not isinstance(self.image_bidirectional, bool):
            fail("image_bidirectional", "it must be true or false")
        if self.x0_clip is not None and (not is_real(self.x0_clip) or self.x0_clip <= 0):
            fail("x0_clip", "it must be a finite number > 0 or null")
        if self.patch_encoder not in ("linear", "unet"):
            fail("patch_encoder", 'it must be "linear" or "unet"')
        for name in ("unet_channels", "unet_blocks"):
            if not is_int(getattr(self, name)) or getattr(self, name) <= 0:
                fail(name, "it must be a positive integer")
        if self.latent_grid is not None:
            grid = self.latent_grid
            if isinstance(grid, str) or not hasattr(grid, "__len__") or len(grid) != 2 or not all(
                    is_int(side) and side > 0 for side in grid):
                fail("latent_grid", "it must be [height, width], two positive integers")
            object.__setattr__(self, "latent_grid", (int(grid[0]), int(grid[1])))
            if is_int(self.patch_size) and (grid[0] % self.patch_size or grid[1] % self.patch_size):
                fail("latent_grid", f"patch_size {self.patch_size} must divide its height and width")

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> TransfusionOptions:
        """From `--model.family_options`; an unknown key is an error naming the known ones."""
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ValueError(f"the transfusion family has no model.family_options {unknown}; its options: {known}")
        return cls(**values)

    @property
    def latent_dim(self) -> int:
        """Values per patch vector: C * k * k."""
        return self.latent_channels * self.patch_size ** 2
