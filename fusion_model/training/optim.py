"""Chameleon's optimiser recipe: AdamW with weight decay on matrices only, linear warmup then exponential or cosine decay."""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass

import torch
from torch import nn

from fusion_model.layers.roles import NORM, parameter_roles


def param_groups(model: nn.Module, weight_decay: float, undecayed: Collection[nn.Parameter] = ()) -> list[dict]:
    """Split parameters into a decayed group (matrices: >= 2 dims) and a non-decayed one (norm weights, biases, and
    `undecayed`: a matrix of which only some rows train, whose other rows decay must not reach)."""
    decay, no_decay = [], []
    kept = {id(p) for p in undecayed}
    for _, param, role in parameter_roles(model):
        if not param.requires_grad:
            continue
        # Embeddings and projections are matrices; norm gains and biases are not. QK-norm's per-head
        # weight is (n_heads, head_dim) — a 2-D gain, not a projection — so a norm's role excludes it too.
        (decay if param.ndim >= 2 and role != NORM and id(param) not in kept else no_decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_adamw(
    model: nn.Module,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.95),
    eps: float = 1e-5,
    weight_decay: float = 0.1,
    fused: bool | None = None,
    undecayed: Collection[nn.Parameter] = (),
) -> torch.optim.AdamW:
    """AdamW over `param_groups`; fused kernels where the parameters live on CUDA (unless told otherwise)."""
    groups = param_groups(model, weight_decay, undecayed)
    if fused is None:
        fused = all(p.is_cuda for g in groups for p in g["params"]) and torch.cuda.is_available()
    return torch.optim.AdamW(groups, lr=lr, betas=tuple(betas), eps=eps, fused=fused or None)


@dataclass
class WarmupDecay:
    """lr multiplier: linear warmup over `warmup_steps`, then exponential or cosine decay to `min_ratio` at `decay_steps`.

    A picklable callable (LambdaLR saves its `__dict__`: plain numbers only, so checkpoints stay weights_only-safe).
    The paper decays exponentially "to 0"; an exponential never reaches 0, so it reaches `min_ratio` at
    `decay_steps` and keeps decaying at the same rate afterwards. Cosine stays at `min_ratio` after `decay_steps`.
    """

    warmup_steps: int
    decay_steps: int
    schedule: str = "exponential"
    min_ratio: float = 0.01

    def __post_init__(self) -> None:
        if self.schedule not in {"exponential", "cosine", "constant"}:
            raise ValueError(f"lr schedule {self.schedule!r}: choose 'exponential', 'cosine' or 'constant'")
        if self.decay_steps <= self.warmup_steps and self.schedule != "constant":
            raise ValueError(
                f"decay_steps ({self.decay_steps}) must exceed warmup_steps ({self.warmup_steps}); "
                "set trainer.max_steps or model.decay_steps larger, or lower model.warmup_steps"
            )
        if not 0.0 < self.min_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in (0, 1], got {self.min_ratio}")

    def __call__(self, step: int) -> float:
        """Multiplier of the peak lr at optimizer step `step` (0-based)."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.schedule == "constant":
            return 1.0
        progress = (step - self.warmup_steps) / (self.decay_steps - self.warmup_steps)
        if self.schedule == "exponential":
            return self.min_ratio**progress
        progress = min(progress, 1.0)
        return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclass(frozen=True)
class OptimizerRecipe:
    """The optimizer half of a training recipe (`--model.lr`, `--model.betas`, ...; defaults: Chameleon's): AdamW with
    decay on matrices only, and the warmup/decay schedule. Numbers that would train nothing or NaN are refused when
    the recipe is made, naming the option."""

    lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-5
    weight_decay: float = 0.1
    warmup_steps: int = 4000
    lr_schedule: str = "exponential"
    decay_steps: int | None = None  # where the lr reaches min_lr_ratio x lr (None: trainer.max_steps)
    min_lr_ratio: float = 0.01

    def __post_init__(self) -> None:
        def number(value: object) -> bool:
            return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)

        def whole(value: object) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        betas = self.betas
        rules = [("lr", number(self.lr) and self.lr > 0, "a finite number > 0"),
                 ("betas", len(tuple(betas)) == 2 and all(number(b) and 0 <= b < 1 for b in betas),
                  "two numbers in [0, 1)"),
                 ("eps", number(self.eps) and self.eps > 0, "a finite number > 0"),
                 ("weight_decay", number(self.weight_decay) and self.weight_decay >= 0, "a finite number >= 0"),
                 ("min_lr_ratio", number(self.min_lr_ratio) and 0 <= self.min_lr_ratio <= 1, "a number in [0, 1]"),
                 ("warmup_steps", whole(self.warmup_steps) and self.warmup_steps >= 0, "an integer >= 0"),
                 ("decay_steps", self.decay_steps is None or (whole(self.decay_steps) and self.decay_steps > 0),
                  "a positive integer or null")]
        for name, ok, rule in rules:
            if not ok:
                raise ValueError(f"--model.{name}={getattr(self, name)!r} is invalid: it must be {rule}")

    def optimizer(self, module: nn.Module, undecayed: Collection[nn.Parameter] = ()) -> torch.optim.AdamW:
        """AdamW over the module's trainable parameters (frozen ones are left out; `undecayed` get no decay)."""
        return build_adamw(module, lr=self.lr, betas=tuple(self.betas), eps=self.eps, weight_decay=self.weight_decay,
                           undecayed=undecayed)

    def schedule(self, max_steps: int | None) -> WarmupDecay:
        """The lr multiplier over `decay_steps`, or over `max_steps` when the recipe sets no horizon."""
        horizon = self.decay_steps or (max_steps if max_steps and max_steps > 0 else None)
        if horizon is None:
            raise ValueError("set trainer.max_steps or model.decay_steps: the lr schedule needs a horizon")
        return WarmupDecay(min(self.warmup_steps, max(horizon - 1, 0)), horizon, self.lr_schedule, self.min_lr_ratio)


def build_scheduler(optimizer: torch.optim.Optimizer, schedule: WarmupDecay) -> torch.optim.lr_scheduler.LambdaLR:
    """A per-optimizer-step LambdaLR following `schedule`."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
