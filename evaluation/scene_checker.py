"""The scene world's checker: reads the objects of a picture back by rules (no learned weights, so it cannot share a
model's mistakes), decides whether a picture satisfies a prompt by GenEval's rules per skill, and maps a picture to
a fixed vector of continuous features (`FEATURE_NAMES`) for a Fréchet distance and a diversity measure.

Reading (`read_scene`): a pixel is foreground when its brightest channel is above `FOREGROUND` (the world's
background is black); each foreground pixel is named by the nearest colour in chromaticity (the pixel divided by its
brightest channel: blur into black dims a colour but keeps its hue); connected components of each colour smaller
than `MIN_AREA` pixels are specks and ignored; a component is a triangle when its rows are skewed (its mass low: the
world's triangles point up), else the template (square or circle, drawn in the box of its contours at 35, 50 and 65%
of its peak brightness, which a blur moves little) they overlap best (intersection over union).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np
from PIL import Image

from data_shards.scenes import COLOURS, QUADRANTS, SHAPES, Prompt, quadrant_of, shape_mask

FOREGROUND = 0.35  # brightest channel / 255 above which a pixel is an object's
# a component below this many pixels is a speck (the smallest object, a 16-px triangle, covers ~128)
MIN_AREA = 40
# px shrunk off each axis' centroid offset before the direction test: GenEval's 0.1 x (both objects' sizes), at
# the world's ~20-px objects
POSITION_MARGIN = 4.0
CONTOUR_LEVELS = (0.35, 0.5, 0.65)  # fractions of a component's peak brightness whose contours the templates match
TRIANGLE_SKEW = -0.25  # rows' skewness under which a component is a triangle (drawn: -0.57; square, circle: 0)
_COLOUR_NAMES = list(COLOURS)
_CHROMA = np.array([COLOURS[n] for n in _COLOUR_NAMES], dtype=np.float64)
_CHROMA /= _CHROMA.max(axis=1, keepdims=True)


@dataclass(frozen=True)
class ObjectReading:
    """One object read from a picture: shape and colour names, centroid (px), area (px) and quadrant (0-3)."""

    shape: str
    colour: str
    cx: float
    cy: float
    area: int
    quadrant: int


def _pixels(image: np.ndarray | Image.Image) -> np.ndarray:
    """float (H, W, 3) in [0, 1] of a uint8 array or a PIL image."""
    array = np.asarray(image.convert("RGB") if isinstance(image, Image.Image) else image)
    if array.ndim != 3 or array.shape[-1] != 3:
        raise ValueError(f"expected an (H, W, 3) RGB image, got shape {array.shape}")
    return array.astype(np.float64) / 255.0


def _components(mask: np.ndarray) -> list[np.ndarray]:
    """The 8-connected components of a boolean mask, each as an (n, 2) array of (row, col)."""
    seen = np.zeros_like(mask, dtype=bool)
    height, width = mask.shape
    out = []
    for start in zip(*np.nonzero(mask)):
        if seen[start]:
            continue
        seen[start] = True
        queue, members = deque([start]), []
        while queue:
            r, c = queue.popleft()
            members.append((r, c))
            for dr in (-1, 0, 1):
                for dc in (-1, 0, 1):
                    rr, cc = r + dr, c + dc
                    if 0 <= rr < height and 0 <= cc < width and mask[rr, cc] and not seen[rr, cc]:
                        seen[rr, cc] = True
                        queue.append((rr, cc))
        out.append(np.array(members))
    return out


def _read_shape(brightness: np.ndarray, members: np.ndarray) -> str:
    """The component's shape: triangle by the skewness of its rows, else the template (square, circle) that best
    overlaps (IoU, summed over the contours at `CONTOUR_LEVELS` of its peak) its pixels, drawn in their box."""
    values = brightness[members[:, 0], members[:, 1]]
    # a triangle (apex up) has its mass low in its rows (skewness of the rows, brightness-weighted: -0.57 when
    # drawn, about -0.45 after a 5x5 blur), a square or circle none: a moment a blur keeps, where a small triangle's
    # blurred silhouette already matches a circle best
    weights = values / values.sum()
    rows = members[:, 0].astype(np.float64)
    mean = (weights * rows).sum()
    variance = (weights * (rows - mean) ** 2).sum()
    if (weights * (rows - mean) ** 3).sum() / max(variance, 1e-9) ** 1.5 < TRIANGLE_SKEW:
        return "triangle"
    peak = float(np.percentile(values, 90))
    candidates = [s for s in SHAPES if s != "triangle"]
    scores = np.zeros(len(candidates))
    # several contours, not one: a blurred edge row sits near any one level, where noise makes it ragged
    for level in CONTOUR_LEVELS:
        keep = members[values > peak * level]
        top, left = keep.min(axis=0)
        height, width = keep.max(axis=0) + 1 - (top, left)
        side = int(max(height, width))  # the templates are drawn in a side x side crop at the box's corner
        cover = np.zeros((side, side), dtype=bool)
        cover[keep[:, 0] - top, keep[:, 1] - left] = True
        for i, shape in enumerate(candidates):
            drawn = shape_mask(shape, 0.0, 0.0, float(width), float(height), side) > 0.5
            scores[i] += float((cover & drawn).sum() / max((cover | drawn).sum(), 1))
    return candidates[int(np.argmax(scores))]


def colour_labels(image: np.ndarray | Image.Image) -> np.ndarray:
    """int (H, W): the index in COLOURS of each foreground pixel's nearest colour by chromaticity, -1 for
    background."""
    return _labels(_pixels(image))


def _labels(pixels: np.ndarray) -> np.ndarray:
    """`colour_labels` of float pixels in [0, 1]."""
    brightness = pixels.max(axis=-1)
    chroma = pixels / np.maximum(brightness, 1e-6)[..., None]
    nearest = ((chroma[..., None, :] - _CHROMA) ** 2).sum(axis=-1).argmin(axis=-1)
    return np.where(brightness > FOREGROUND, nearest, -1)


def read_scene(image: np.ndarray | Image.Image) -> list[ObjectReading]:
    """The objects of a picture (uint8 (H, W, 3) or PIL): components of each colour of at least MIN_AREA pixels,
    with their shape, centroid, area and quadrant, in reading order (top to bottom, then left to right)."""
    pixels = _pixels(image)
    brightness = pixels.max(axis=-1)
    labels = _labels(pixels)
    readings = []
    for index, name in enumerate(_COLOUR_NAMES):
        for members in _components(labels == index):
            if len(members) < MIN_AREA:
                continue
            cy, cx = members.mean(axis=0) + 0.5  # pixel centres
            readings.append(ObjectReading(_read_shape(brightness, members), name, float(cx), float(cy),
                                          len(members), quadrant_of(cx, cy, max(pixels.shape[:2]))))
    return sorted(readings, key=lambda r: (r.quadrant, r.cy, r.cx))


def _relation_holds(relation: str, a: ObjectReading, b: ObjectReading) -> bool:
    """Whether `a` is `relation` `b`, by GenEval's rule on centroids: each axis' offset shrunk by POSITION_MARGIN,
    divided by the offset's length, must exceed 0.5 along the relation's direction (within ~60 degrees of it), so
    a pair stacked in one column is not "left of" (image y grows downwards)."""
    offset = np.array([b.cx - a.cx, b.cy - a.cy])  # from a to b: "a left of b" means b lies to the right
    length = float(np.hypot(*offset))
    shrunk = np.maximum(np.abs(offset) - POSITION_MARGIN, 0.0) * np.sign(offset)
    if length == 0 or not shrunk.any():
        return False
    dx, dy = shrunk / length
    return {"left of": dx > 0.5, "right of": -dx > 0.5, "above": dy > 0.5, "below": -dy > 0.5}[relation]


def satisfies(prompt: Prompt, readings: list[ObjectReading]) -> bool:
    """GenEval's rule for the prompt's skill: single_object exactly one object, of the shape; two_objects both
    shapes present; counting exactly `count` objects of the shape and no others; colours an object of the shape in
    the colour; position an object of each shape with the relation between their centroids; colour_attribution both
    (colour, shape) pairs present."""
    shapes = [r.shape for r in readings]
    pairs = {(r.colour, r.shape) for r in readings}
    if prompt.skill == "single_object":
        return shapes == [prompt.shapes[0]]
    if prompt.skill == "two_objects":
        return all(s in shapes for s in prompt.shapes)
    if prompt.skill == "counting":
        return len(readings) == prompt.count and all(s == prompt.shapes[0] for s in shapes)
    if prompt.skill in ("colours", "colour_attribution"):
        return all((c, s) in pairs for c, s in zip(prompt.colours, prompt.shapes))
    if prompt.skill == "position":
        first = [r for r in readings if r.shape == prompt.shapes[0]]
        second = [r for r in readings if r.shape == prompt.shapes[1]]
        return any(_relation_holds(prompt.relation, a, b) for a in first for b in second)
    raise ValueError(f"unknown skill {prompt.skill!r}")


# ---------------------------------------------------------------- features for Fréchet distance and diversity

# per quadrant: how much is drawn, its brightness and mean chromaticity (colour), its centroid's offset from the
# quadrant's centre (place), and its spread, fill and vertical skew (shape: a square fills its box, a circle 79%, a
# triangle 50% and is heavier at the bottom); all continuous, so the covariance over a set of pictures is full rank
_PER_QUADRANT = ("fg_fraction", "brightness", "chroma_r", "chroma_g", "chroma_b", "offset_x", "offset_y",
                 "spread_xx", "spread_yy", "spread_xy", "fill", "skew_y")
FEATURE_NAMES: tuple[str, ...] = tuple(f"{q.replace(' ', '_')}.{name}" for q in QUADRANTS for name in _PER_QUADRANT)
FEATURE_DIM = len(FEATURE_NAMES)  # 48


def _quadrant_features(pixels: np.ndarray) -> list[float]:
    """The `_PER_QUADRANT` features of one quadrant's (h, w, 3) pixels in [0, 1]."""
    brightness = pixels.max(axis=-1)
    fg = brightness > FOREGROUND
    n = int(fg.sum())
    if n < 3:
        return [n / fg.size] + [0.0] * (len(_PER_QUADRANT) - 1)
    rows, cols = np.nonzero(fg)
    half_h, half_w = fg.shape[0] / 2, fg.shape[1] / 2
    y, x = (rows + 0.5 - half_h) / half_h, (cols + 0.5 - half_w) / half_w  # -1..1 across the quadrant
    chroma = (pixels[fg] / brightness[fg][:, None]).mean(axis=0)
    my, mx = y.mean(), x.mean()
    syy, sxx, sxy = ((y - my) ** 2).mean(), ((x - mx) ** 2).mean(), ((x - mx) * (y - my)).mean()
    box = (rows.max() - rows.min() + 1) * (cols.max() - cols.min() + 1)
    skew = ((y - my) ** 3).mean() / max(syy, 1e-9) ** 1.5
    return [n / fg.size, float(brightness[fg].mean()), *map(float, chroma), float(mx), float(my), float(sxx),
            float(syy), float(sxy), n / box, float(skew)]


def scene_features(image: np.ndarray | Image.Image) -> np.ndarray:
    """float64 (FEATURE_DIM,) of a picture: `_PER_QUADRANT` features of each quadrant (names: FEATURE_NAMES)."""
    pixels = _pixels(image)
    h, w = pixels.shape[0] // 2, pixels.shape[1] // 2
    parts = [pixels[:h, :w], pixels[:h, w:], pixels[h:, :w], pixels[h:, w:]]
    return np.array([v for part in parts for v in _quadrant_features(part)], dtype=np.float64)

