"""Randomness keyed by the data, not by a rank's generator: numbers that are a pure function of (seed, step, stream,
sample key), so an objective drawing them gives the same result on any rank, in any batch row or micro-batch, and
after a resume."""

from __future__ import annotations

import hashlib

import torch

_MASK = (1 << 64) - 1


def _mix(value: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 tensors (wrapping arithmetic): a key -> 64 well-mixed bits."""
    # int64 multiplication wraps like uint64 in two's complement; the right shifts must be logical, so mask the
    # sign bits the arithmetic shift drags in
    def shift(x: torch.Tensor, bits: int) -> torch.Tensor:
        return (x >> bits) & ((1 << (64 - bits)) - 1)

    value = value ^ shift(value, 30)
    value = value * _signed(0xBF58476D1CE4E5B9)
    value = value ^ shift(value, 27)
    value = value * _signed(0x94D049BB133111EB)
    return value ^ shift(value, 31)


def _signed(value: int) -> int:
    value &= _MASK
    return value - (1 << 64) if value >= 1 << 63 else value


def _base_key(seed: int, step: int, stream: str) -> int:
    digest = hashlib.sha256(f"{seed}/{step}/{stream}".encode()).digest()
    return _signed(int.from_bytes(digest[:8], "little"))


def keyed_uniform(keys: torch.Tensor, *, seed: int, step: int, stream: str, draws: int = 1) -> torch.Tensor:
    """Uniform numbers in (0, 1), shape (*keys.shape, draws), a pure function of (seed, step, stream, key, draw).

    The same sample gets the same numbers whichever rank, batch row or micro-batch it lands in, so objectives whose
    randomness is drawn this way stay exact under a changed world size and on resume. `stream` names the use
    (e.g. "timestep", "noise") so two uses never share numbers.
    """
    keys = keys.long()
    counter = torch.arange(draws, device=keys.device, dtype=torch.long)
    mixed = _mix(_mix(keys[..., None] ^ _base_key(seed, step, stream)) + counter * _signed(0x9E3779B97F4A7C15))
    top = (mixed >> 11) & ((1 << 53) - 1)  # 53 random bits -> an exact double in [0, 1)
    return ((top.double() + 0.5) / float(1 << 53)).float().clamp(1e-7, 1 - 1e-7)


def keyed_normal(keys: torch.Tensor, *, seed: int, step: int, stream: str, draws: int = 1) -> torch.Tensor:
    """Standard normal numbers, shape (*keys.shape, draws), keyed as `keyed_uniform` (Box-Muller)."""
    pairs = keyed_uniform(keys, seed=seed, step=step, stream=stream, draws=2 * ((draws + 1) // 2))
    first, second = pairs[..., 0::2].double(), pairs[..., 1::2].double()
    radius = torch.sqrt(-2.0 * torch.log(first))
    angle = 2.0 * torch.pi * second
    return torch.cat([radius * torch.cos(angle), radius * torch.sin(angle)], dim=-1)[..., :draws].float()


def keyed_generator(keys: torch.Tensor, *, seed: int, step: int, stream: str,
                    device: torch.device | str = "cpu") -> torch.Generator:
    """A torch.Generator seeded by (seed, step, stream) and the set of keys (order-free): for randomness that is a
    function of a whole batch (e.g. BLIP-2's hard negatives, drawn within the batch)."""
    unique = torch.unique(keys.long().flatten().cpu())
    digest = hashlib.sha256(f"{seed}/{step}/{stream}/".encode() + unique.numpy().tobytes()).digest()
    return torch.Generator(device=device).manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
