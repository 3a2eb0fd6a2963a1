"""A document's parts as ids: its segments (LatentImage), its runs (Span, find_spans) and code lists as grids."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

Segment = "str | torch.Tensor | np.ndarray"


@dataclass(frozen=True)
class LatentImage:
    """A continuous image as a document segment (Transfusion): `patches` `<image>` placeholder positions between
    `<boi>` and `<eoi>`, whose latent patches travel beside the ids."""

    patches: int


@dataclass(frozen=True)
class Span:
    """One run of an id sequence (UnifiedVocab.spans): text, an image from its `<boi>` to its `<eoi>`, or a video
    clip from its `<bov>` to its `<eov>`."""

    kind: str  # "text", "image" or "video"
    start: int  # position of the first id (an image's <boi>, a clip's <bov>)
    end: int  # one past the last id (past an image's <eoi> / a clip's <eov> when it has one)
    # False for an image (clip) cut short: the sequence ends, or another <boi> / <bov> comes before its end marker
    closed: bool = True

    @property
    def is_image(self) -> bool:
        """Whether this run is an image (a clip is not: see is_video, is_visual)."""
        return self.kind == "image"

    @property
    def is_video(self) -> bool:
        """Whether this run is a video clip."""
        return self.kind == "video"

    @property
    def is_visual(self) -> bool:
        """Whether this run is an image or a clip: codes of the image block between two markers."""
        return self.kind != "text"

    @property
    def body(self) -> slice:
        """Positions of the content: all of a text run; an image's (clip's) ids between its two markers."""
        if not self.is_visual:
            return slice(self.start, self.end)
        return slice(self.start + 1, self.end - 1 if self.closed else self.end)


def find_spans(ids: list[int], boi_id: int, eoi_id: int, bov_id: int | None, eov_id: int | None) -> list[Span]:
    """The runs of `ids` given the marker ids (bov_id / eov_id None: no clips); UnifiedVocab.spans describes them.

    Never raises: everything between `<boi>` and the next `<eoi>` (`<bov>` and the next `<eov>`) belongs to the
    image (clip); one is open (closed=False) when the sequence or the next `<boi>` / `<bov>` comes first.
    """
    spans: list[Span] = []
    start, kind = 0, "text"
    closer = {"image": eoi_id, "video": eov_id}
    for position, i in enumerate(ids):
        if i == boi_id or (i == bov_id and bov_id is not None):
            if position > start:
                spans.append(Span(kind, start, position, closed=kind == "text"))
            start, kind = position, "image" if i == boi_id else "video"
        elif kind != "text" and i == closer[kind]:
            spans.append(Span(kind, start, position + 1))
            start, kind = position + 1, "text"
    if len(ids) > start:
        spans.append(Span(kind, start, len(ids), closed=kind == "text"))
    return spans


def grid_of(codes: list[int], grid_shape: tuple[int, int] | None, position: int) -> torch.Tensor:
    """A closed image's codes as a LongTensor: (h, w) = grid_shape (the count must match), else a square grid
    when the count is square, else 1-D; `position` (its `<eoi>`) names it in the error."""
    flat = torch.tensor(codes, dtype=torch.long)
    if grid_shape is not None:
        h, w = grid_shape
        if len(codes) != h * w:
            raise ValueError(
                f"image ending at position {position} has {len(codes)} codes, not {h}x{w}={h * w}"
            )
        return flat.reshape(h, w)
    side = math.isqrt(len(codes))
    return flat.reshape(side, side) if side * side == len(codes) and codes else flat


def clip_of(codes: list[int], video_grid: tuple[int, int, int] | None, grid_shape: tuple[int, int] | None,
            position: int) -> torch.Tensor:
    """A closed clip's codes as a LongTensor: (t, h, w) = video_grid (the count must match), else (count / (h*w),
    h, w) when grid_shape (h, w) divides the count, else 1-D; `position` (its `<eov>`) names it in the error."""
    flat = torch.tensor(codes, dtype=torch.long)
    if video_grid is not None:
        t, h, w = video_grid
        if len(codes) != t * h * w:
            raise ValueError(
                f"clip ending at position {position} has {len(codes)} codes, not {t}x{h}x{w}={t * h * w}"
            )
        return flat.reshape(t, h, w)
    if grid_shape is not None and codes and len(codes) % (grid_shape[0] * grid_shape[1]) == 0:
        return flat.reshape(-1, *grid_shape)
    return flat
