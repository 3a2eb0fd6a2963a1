"""SamplingConfig: mode, per-modality temperature / top-k / top-p, penalty, guidance; all checked up front."""

from __future__ import annotations

import functools
import math
import numbers
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

MODES = ("text", "image", "interleaved", "video")


@dataclass
class SamplingConfig:
    """How to sample. Temperature 0 means greedy; top_k 0 and top_p 1.0 mean no truncation.

    Guidance (image tokens only): two-stream `u + cfg_scale·(c − u)` when cfg_scale != 1 (or when
    unconditional prompts are passed explicitly); three-stream
    `u + cfg_image_scale·(img − u) + cfg_text_scale·(full − img)` when both of those are set.

    speculative_window N >= 2 turns on speculative Jacobi decoding inside images (`speculative.SpeculativeStep`):
    each forward checks N drafted image codes, the same distribution as plain sampling in fewer forwards.

    Every field is checked when the config is made (ValueError naming the field, and the `train.py generate`
    option for a number): its type (a bool for a bool, a whole number for an int, a finite number for a float:
    NaN would pass every range check below and infinity is no setting), then its range.
    """

    # "text" | "image" (text-to-image: one image, <boi> forced) | "interleaved" | "video" (text-to-video: one clip,
    # <bov> forced, needs video_grid and a vocabulary with video markers)
    mode: str = "interleaved"
    max_new_tokens: int | None = None  # None: text until eos or the context is full; image: h·w + 2; video: t·h·w + 2
    text_temperature: float = 1.0
    text_top_k: int = 0
    text_top_p: float = 1.0
    image_temperature: float = 1.0
    image_top_k: int = 0
    image_top_p: float = 1.0
    repetition_penalty: float = 1.0  # text tokens only (HF convention: > 1 discourages repeats)
    cfg_scale: float = 1.0
    cfg_image_scale: float | None = None
    cfg_text_scale: float | None = None
    seed: int | None = None
    image_grid: tuple[int, int] | None = None  # (h, w) codes per image; generate() takes the tokenizer's
    # (t, h, w) codes per video clip (time, rows, columns), from the video tokenizer like image_grid; None: no clips
    # (interleaved sampling then never opens one)
    video_grid: tuple[int, int, int] | None = None
    stop_at_eos: bool = True
    use_kv_cache: bool = True  # False recomputes the whole sequence every step (the reference path)
    compile: bool = False  # torch.compile the decode step (CUDA: as a CUDA graph); same tokens, a one-off compile
    speculative_window: int = 0  # 0: one token per forward; N >= 2: N image-code drafts checked per forward

    def __post_init__(self) -> None:
        self._check_types()
        if self.mode not in MODES:
            raise ValueError(f"SamplingConfig.mode={self.mode!r}; choose one of {MODES}")
        for name in ("text_temperature", "image_temperature"):
            if getattr(self, name) < 0:
                raise ValueError(f"SamplingConfig.{name}={getattr(self, name)} must be >= 0 (0 = greedy)")
        for name in ("text_top_p", "image_top_p"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ValueError(f"SamplingConfig.{name}={getattr(self, name)} must be in (0, 1]")
        for name in ("text_top_k", "image_top_k"):
            if getattr(self, name) < 0:
                raise ValueError(f"SamplingConfig.{name}={getattr(self, name)} must be >= 0 (0 = off)")
        if self.repetition_penalty <= 0:
            raise ValueError(f"SamplingConfig.repetition_penalty={self.repetition_penalty} must be > 0")
        if (self.cfg_image_scale is None) != (self.cfg_text_scale is None):
            raise ValueError(
                "three-stream guidance needs both cfg_image_scale and cfg_text_scale (or neither)"
            )
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"SamplingConfig.max_new_tokens={self.max_new_tokens} must be >= 1 or None")
        if self.image_grid is not None:
            self.image_grid = (int(self.image_grid[0]), int(self.image_grid[1]))
            if min(self.image_grid) < 1:
                raise ValueError(f"SamplingConfig.image_grid={self.image_grid} must be positive")
        if self.video_grid is not None:
            self.video_grid = tuple(int(v) for v in self.video_grid)
            if min(self.video_grid) < 1:
                raise ValueError(f"SamplingConfig.video_grid={self.video_grid} must be positive")
        if self.compile and not self.use_kv_cache:
            raise ValueError(
                "SamplingConfig.compile needs the KV cache: without it every step has a new shape and would compile "
                "again; drop --no-kv-cache or --compile"
            )
        if self.speculative_window != 0 and self.speculative_window < 2:
            raise ValueError(
                f"SamplingConfig.speculative_window={self.speculative_window} must be 0 (off) or >= 2 "
                "(the image-code drafts checked per forward pass)"
            )

    def _check_types(self) -> None:
        """Refuse a value that is not of its field's annotated type, and a float that is not finite."""
        hints = _field_types(type(self))
        for field in fields(self):
            name, value = field.name, getattr(self, field.name)
            kind, optional = _without_none(hints[name])
            if value is None and optional:
                continue
            where = f"SamplingConfig.{name}={value!r}"
            if kind is bool:
                if not isinstance(value, bool):
                    raise ValueError(f"{where} must be True or False")
            elif kind is int:
                if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                    raise ValueError(f"{where} must be a whole number{_flag(name)}")
            elif kind is float:
                if isinstance(value, bool) or not isinstance(value, numbers.Real):
                    raise ValueError(f"{where} must be a number{_flag(name)}")
                if not math.isfinite(value):
                    raise ValueError(f"{where} must be a finite number{_flag(name)}")
            elif kind is str:
                if not isinstance(value, str):
                    raise ValueError(f"{where} must be a string{_flag(name)}")
            elif typing.get_origin(kind) is tuple:  # image_grid: (h, w), video_grid: (t, h, w), whole numbers
                size = len(typing.get_args(kind))
                if (isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or len(value) != size
                        or not all(isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in value)):
                    raise ValueError(f"{where} must be {size} whole numbers")

    @classmethod
    def chameleon(cls, **overrides: Any) -> SamplingConfig:
        """The settings of Chameleon's release: temperature 0.7, top-p 0.9, text penalty 1.2, CFG 1.2/3.0."""
        values: dict[str, Any] = dict(
            text_temperature=0.7, text_top_p=0.9, image_temperature=0.7, image_top_p=0.9,
            repetition_penalty=1.2, cfg_image_scale=1.2, cfg_text_scale=3.0,
        )
        values.update(overrides)
        return cls(**values)

    @property
    def three_stream(self) -> bool:
        """Whether Chameleon's three-stream guidance is on."""
        return self.cfg_image_scale is not None


@functools.cache
def _field_types(config_class: type) -> dict[str, Any]:
    """The resolved annotation of each field of `config_class` (a subclass may add fields)."""
    return typing.get_type_hints(config_class)


def _without_none(hint: Any) -> tuple[Any, bool]:
    """(`X`, True) for `X | None`; (hint, False) otherwise."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return (rest[0] if len(rest) == 1 else hint), True
    return hint, False


def _flag(name: str) -> str:
    """` (--field-name)`: the `train.py generate` option of a number field (fusion_model.cli.generate makes one per
    field by this rule; image_grid and video_grid come from --image-tokenizer and have none)."""
    return "" if name in ("image_grid", "video_grid") else f" (--{name.replace('_', '-')})"
