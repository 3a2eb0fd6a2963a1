"""Gaussian diffusion over continuous vectors: the cosine noise schedule, noising, DDIM steps and guidance.

Nothing here knows a model family: the Transfusion family (fusion_model.families.transfusion.family) trains with
`CosineSchedule.q_sample` and keyed noise; a sampler runs `ddim_sample` (or `ddim_step` itself) over any
sub-sequence of the training steps, mixing a conditional and an unconditional prediction with `guided_noise`.
Time runs t = 0 (least noise) ... steps - 1 (almost pure noise); a step from t to t_prev = -1 returns the clean
estimate.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from fusion_model.layers.keyed_random import keyed_normal

DEFAULT_STEPS = 1000


def cosine_alpha_bars(steps: int = DEFAULT_STEPS, offset: float = 0.008, max_beta: float = 0.999) -> torch.Tensor:
    """alpha_bar_t (float64, (steps,)) of the cosine schedule (Nichol & Dhariwal 2021, eq. 17).

    alpha_bar(u) = f(u) / f(0), f(u) = cos^2((u + s) / (1 + s) * pi / 2); step t's beta_t = 1 - alpha_bar((t + 1) / N)
    / alpha_bar(t / N), clipped at max_beta (which keeps the last step from being exactly pure noise), and alpha_bar_t
    the product of (1 - beta) up to t, as the paper's implementation (and diffusers' "squaredcos_cap_v2") compute it.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"cosine_alpha_bars: steps={steps!r} must be a positive integer")

    def f(u: float) -> float:
        return math.cos((u + offset) / (1 + offset) * math.pi / 2) ** 2

    betas = torch.tensor([min(1 - f((t + 1) / steps) / f(t / steps), max_beta) for t in range(steps)],
                         dtype=torch.float64)
    return torch.cumprod(1 - betas, dim=0)


def _per_item(coefficient: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A coefficient per leading index of `like` (t's shape), broadcast over its remaining dimensions."""
    return coefficient.reshape(*coefficient.shape, *([1] * (like.dim() - coefficient.dim())))


class CosineSchedule:
    """The cosine schedule over `steps` training steps, and what is computed from it."""

    def __init__(self, steps: int = DEFAULT_STEPS) -> None:
        self.steps = steps
        self.alpha_bars = cosine_alpha_bars(steps)

    def alpha_bar(self, t: torch.Tensor) -> torch.Tensor:
        """alpha_bar at integer steps t (any shape; -1 = the clean end, alpha_bar 1), float64 on t's device."""
        t = torch.as_tensor(t, dtype=torch.long)
        # checked on CPU only: on a GPU the check would wait for the device at every step
        if t.device.type == "cpu" and t.numel() and (int(t.min()) < -1 or int(t.max()) >= self.steps):
            raise ValueError(f"diffusion step outside [-1, {self.steps - 1}]: {t.min().item()}..{t.max().item()}")
        table = torch.cat([self.alpha_bars.new_ones(1), self.alpha_bars]).to(t.device)
        return table[t + 1]

    def q_sample(self, x0: torch.Tensor, t: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """x_t = sqrt(alpha_bar_t) x0 + sqrt(1 - alpha_bar_t) noise; t's shape is x0's leading dimensions."""
        alpha_bar = _per_item(self.alpha_bar(t), x0)
        return (alpha_bar.sqrt() * x0.double() + (1 - alpha_bar).sqrt() * noise.double()).to(x0.dtype)

    def predict_x0(self, x_t: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """The clean estimate from a noise prediction: (x_t - sqrt(1 - alpha_bar_t) noise) / sqrt(alpha_bar_t)."""
        alpha_bar = _per_item(self.alpha_bar(t), x_t)
        return ((x_t.double() - (1 - alpha_bar).sqrt() * noise.double()) / alpha_bar.sqrt()).to(x_t.dtype)

    def ddim_step(self, x_t: torch.Tensor, noise: torch.Tensor, t: torch.Tensor,
                  t_prev: torch.Tensor, clip: float | None = None) -> torch.Tensor:
        """One deterministic DDIM step (eta = 0) from t to t_prev < t: sqrt(alpha_bar_prev) x0_hat +
        sqrt(1 - alpha_bar_prev) noise; t_prev = -1 gives x0_hat itself.

        clip: x0_hat clamped to [-clip, clip], and the noise re-derived from the clamped x0_hat (as diffusers'
        DDIM does). Needed from the cosine schedule's last step: alpha_bar there is 2.4e-9, so x0_hat =
        (x_t - sqrt(1 - alpha_bar) noise) / sqrt(alpha_bar) multiplies a noise prediction's error by 2e4, and the
        next step carries it into x_t (a model's samples came out as blobs without it)."""
        x0 = self.predict_x0(x_t, noise, t).double()
        noise = noise.double()
        if clip is not None:
            x0 = x0.clamp(-clip, clip)
            alpha = _per_item(self.alpha_bar(t), x_t)
            noise = (x_t.double() - alpha.sqrt() * x0) / (1 - alpha).sqrt()
        alpha_prev = _per_item(self.alpha_bar(t_prev), x_t)
        return (alpha_prev.sqrt() * x0 + (1 - alpha_prev).sqrt() * noise).to(x_t.dtype)

    def ddim_timesteps(self, num_steps: int) -> torch.Tensor:
        """`num_steps` distinct training steps, evenly spaced from the last (steps - 1) down to 0 (descending)."""
        if isinstance(num_steps, bool) or not isinstance(num_steps, int) or not 1 <= num_steps <= self.steps:
            raise ValueError(f"DDIM: num_steps={num_steps!r} must be an integer in [1, {self.steps}]")
        if num_steps == 1:
            return torch.tensor([self.steps - 1])
        # spacing (steps - 1) / (num_steps - 1) >= 1, so rounding keeps them distinct
        return torch.linspace(self.steps - 1, 0, num_steps, dtype=torch.float64).round().long()


def ddim_sample(predict_noise: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], x_start: torch.Tensor,
                schedule: CosineSchedule, num_steps: int, clip: float | None = None) -> torch.Tensor:
    """Run DDIM (eta = 0) from x_start, pure noise at the schedule's last step, through `num_steps` steps to a clean
    sample; predict_noise(x_t, t) (t a 0-dim long tensor) returns the predicted noise (guided or not); clip: each
    step's x0 estimate clamped to [-clip, clip] (`CosineSchedule.ddim_step`)."""
    timesteps = schedule.ddim_timesteps(num_steps).tolist() + [-1]
    x = x_start
    for t, t_prev in zip(timesteps[:-1], timesteps[1:]):
        step, previous = torch.tensor(t), torch.tensor(t_prev)
        x = schedule.ddim_step(x, predict_noise(x, step), step, previous, clip)
    return x


def guided_noise(conditional: torch.Tensor, unconditional: torch.Tensor, scale: float) -> torch.Tensor:
    """Classifier-free guidance: unconditional + scale * (conditional - unconditional) (scale 1: conditional)."""
    return unconditional + scale * (conditional - unconditional)


def keyed_noise(keys: torch.Tensor, dim: int, *, seed: int, step: int, stream: str) -> torch.Tensor:
    """Standard normal noise (*keys.shape, dim), a pure function of (seed, step, stream, key): the same vector for
    the same key on any rank, in any row or micro-batch, and after a resume (fusion_model.families.base)."""
    return keyed_normal(keys, seed=seed, step=step, stream=stream, draws=dim)
