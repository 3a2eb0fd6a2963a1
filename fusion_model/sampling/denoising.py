"""DiffusionSamplingConfig: SamplingConfig plus the settings of images made by denoising (a diffusion family's)."""

from __future__ import annotations

from dataclasses import dataclass

from fusion_model.sampling.config import SamplingConfig

DEFAULT_DENOISING_STEPS = 50


@dataclass
class DiffusionSamplingConfig(SamplingConfig):
    """SamplingConfig with `denoising_steps`: the DDIM steps per image of a family whose images come from a
    diffusion model (at most the schedule's training steps, which the family checks). A family that samples image
    codes has no use for it; `cfg_scale` is the guidance of both kinds."""

    denoising_steps: int = DEFAULT_DENOISING_STEPS

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.denoising_steps < 1:
            raise ValueError(f"SamplingConfig.denoising_steps={self.denoising_steps} must be >= 1 "
                             "(--denoising-steps)")


def denoising_steps(config: SamplingConfig) -> int:
    """The DDIM steps per image `config` asks for (the default for a plain SamplingConfig)."""
    return int(getattr(config, "denoising_steps", DEFAULT_DENOISING_STEPS))
