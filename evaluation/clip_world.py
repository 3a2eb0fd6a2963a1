"""The clip world of the `clips` suite (and of the video experiment, which trains on it): seeded synthetic clips of
coloured shapes moving in 4 directions, their captions, the held-out split (new clips, and colour+shape+direction
triples never trained on), and an independent rule-based checker that reads colour, shape and direction back from
pixels (no learned weights: it cannot share a model's mistakes). It reads every ground-truth clip right
(tests/evaluation/test_clip_world.py)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from data_shards.scenes import shape_mask

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (230, 40, 40), "green": (40, 210, 60), "blue": (50, 90, 240), "yellow": (235, 215, 40)}
SHAPES = ("square", "circle", "triangle")
DIRECTIONS: dict[str, tuple[int, int]] = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}  # (dx, dy)
FRAMES, SIZE = 8, 32
# the checker's thresholds: a pixel is foreground when its brightest channel is above this (background is black)
FOREGROUND = 0.35


@dataclass(frozen=True)
class ClipSpec:
    """What one clip shows: the caption's three words and the drawing's free parameters."""

    colour: str
    shape: str
    direction: str
    side: float  # the shape's width and height in pixels
    x: float  # top-left corner in the first frame
    y: float
    speed: float  # pixels per frame

    @property
    def caption(self) -> str:
        """`a red square moving left`."""
        return caption(self.colour, self.shape, self.direction)

    @property
    def triple(self) -> tuple[str, str, str]:
        """(colour, shape, direction)."""
        return self.colour, self.shape, self.direction


def caption(colour: str, shape: str, direction: str) -> str:
    """The caption of a clip: `a <colour> <shape> moving <direction>`."""
    return f"a {colour} {shape} moving {direction}"


def all_triples() -> list[tuple[str, str, str]]:
    """Every (colour, shape, direction), 4 x 3 x 4 = 48."""
    return list(itertools.product(COLOURS, SHAPES, DIRECTIONS))


def held_out_triples(count: int, seed: int) -> list[tuple[str, str, str]]:
    """`count` triples never trained on, chosen by the seed so that the training triples still show every colour
    with every shape, every colour with every direction and every shape with every direction (a held-out caption
    combines words that were all seen, in pairs too, but never together as three)."""
    rng = np.random.default_rng(seed)
    triples = all_triples()
    chosen: list[tuple[str, str, str]] = []
    for index in rng.permutation(len(triples)):
        candidate = triples[index]
        kept = [t for t in triples if t not in chosen and t != candidate]
        pairs_kept = all(any(t[i] == candidate[i] and t[j] == candidate[j] for t in kept)
                         for i, j in ((0, 1), (0, 2), (1, 2)))
        if pairs_kept:
            chosen.append(candidate)
        if len(chosen) == count:
            return sorted(chosen)
    raise ValueError(f"cannot hold out {count} triples and keep every pair of words in training")


def random_spec(rng: np.random.Generator, triple: tuple[str, str, str], frames: int = FRAMES,
                size: int = SIZE) -> ClipSpec:
    """A clip of `triple` with a random side (9-12 px), speed (1.25-2 px per frame) and a start that keeps the
    shape inside the frame for all `frames`."""
    colour, shape, direction = triple
    side = float(rng.uniform(9.0, 12.0))
    speed = float(rng.uniform(1.25, 2.0))
    travel = speed * (frames - 1)
    dx, dy = DIRECTIONS[direction]

    def start(step: int) -> float:
        room = size - side - travel * abs(step)
        low = travel if step < 0 else 0.0
        return low + float(rng.uniform(0.0, max(room, 0.0)))

    return ClipSpec(colour, shape, direction, side, start(dx), start(dy), speed)


def _mask(shape: str, side: float, x: float, y: float, size: int) -> np.ndarray:
    """The shape's coverage of each pixel (size, size) in [0, 1]: the scene world's drawing, in a square box."""
    return shape_mask(shape, x, y, side, side, size)


def render(spec: ClipSpec, frames: int = FRAMES, size: int = SIZE) -> np.ndarray:
    """The clip as uint8 (frames, size, size, 3): the shape in its colour on black, moving `speed` px per frame."""
    dx, dy = DIRECTIONS[spec.direction]
    colour = np.asarray(COLOURS[spec.colour], dtype=np.float64)
    out = np.empty((frames, size, size, 3), dtype=np.uint8)
    for t in range(frames):
        cover = _mask(spec.shape, spec.side, spec.x + dx * spec.speed * t, spec.y + dy * spec.speed * t, size)
        out[t] = np.rint(cover[..., None] * colour).astype(np.uint8)
    return out


@dataclass
class ClipSet:
    """Clips (N, T, H, W, 3) uint8 with what each shows."""

    clips: np.ndarray
    specs: list[ClipSpec]

    @property
    def captions(self) -> list[str]:
        """Each clip's caption, in order."""
        return [s.caption for s in self.specs]

    def __len__(self) -> int:
        """How many clips."""
        return len(self.specs)


def make_clips(triples: list[tuple[str, str, str]], count: int, seed: int, frames: int = FRAMES,
               size: int = SIZE) -> ClipSet:
    """`count` clips cycling through `triples` (as even a spread as the count allows), each drawn with its own
    random side, speed and start from `seed`."""
    if not triples:
        raise ValueError("make_clips needs at least one (colour, shape, direction) triple")
    rng = np.random.default_rng(seed)
    order = [triples[i % len(triples)] for i in range(count)]
    specs = [random_spec(rng, triple, frames, size) for triple in order]
    clips = np.stack([render(s, frames, size) for s in specs]) if specs else np.zeros((0, frames, size, size, 3),
                                                                                        np.uint8)
    return ClipSet(clips, specs)


@dataclass
class VideoSplit:
    """The experiment's clips: training, held-out clips of trained triples, clips of held-out triples."""

    train: ClipSet
    held_out: ClipSet  # new clips of triples seen in training
    novel: ClipSet  # clips of triples never seen in training
    novel_triples: list[tuple[str, str, str]]


def make_split(train: int, held_out: int, novel: int, novel_triples: int = 6, seed: int = 0) -> VideoSplit:
    """The seeded split: `train` clips of the trained triples, `held_out` new ones of the same triples, `novel`
    clips of `novel_triples` triples no training clip shows."""
    unseen = held_out_triples(novel_triples, seed)
    seen = [t for t in all_triples() if t not in unseen]
    return VideoSplit(make_clips(seen, train, seed + 1), make_clips(seen, held_out, seed + 2),
                      make_clips(unseen, novel, seed + 3), unseen)


def to_model_clips(clips: np.ndarray) -> torch.Tensor:
    """uint8 (N, T, H, W, 3) -> float (N, T, 3, H, W) in [-1, 1] (the video tokenizer's input)."""
    return torch.from_numpy(np.ascontiguousarray(clips)).permute(0, 1, 4, 2, 3).float() / 127.5 - 1.0


def to_uint8_clips(clips: torch.Tensor) -> np.ndarray:
    """float (N, T, 3, H, W) in [-1, 1] -> uint8 (N, T, H, W, 3)."""
    pixels = ((clips.detach().float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    return pixels.permute(0, 1, 3, 4, 2).cpu().numpy()


# ---------------------------------------------------------------- the checker


@dataclass(frozen=True)
class Reading:
    """What the checker read from one clip (None where it could not read anything)."""

    colour: str | None
    shape: str | None
    direction: str | None


def _frame_features(frame: np.ndarray) -> tuple[np.ndarray, str, float, float] | None:
    """(mean foreground colour 0..1, shape, centroid x, centroid y) of one (H, W, 3) uint8 frame; None when
    fewer than 3 pixels are foreground."""
    pixels = frame.astype(np.float64) / 255.0
    brightness = pixels.max(axis=-1)
    fg = brightness > FOREGROUND
    if fg.sum() < 3:
        return None
    rows, cols = np.nonzero(fg)
    return pixels[fg].mean(axis=0), read_shape(brightness), float(cols.mean()), float(rows.mean())


def read_shape(brightness: np.ndarray) -> str:
    """The shape whose drawing best overlaps (intersection over union) the pixels at least half as bright as the
    shape, drawn in their box: a template match on the half-brightness contour, which blur moves little."""
    fg = brightness > FOREGROUND
    peak = float(np.percentile(brightness[fg], 90))
    cover = brightness > peak / 2
    rows, cols = np.nonzero(cover)
    side = ((cols.max() - cols.min() + 1) + (rows.max() - rows.min() + 1)) / 2
    x, y = (cols.min() + cols.max() + 1) / 2 - side / 2, (rows.min() + rows.max() + 1) / 2 - side / 2
    overlaps = []
    for shape in SHAPES:
        drawn = _mask(shape, side, x, y, brightness.shape[0]) > 0.5
        overlaps.append(float((cover & drawn).sum() / max((cover | drawn).sum(), 1)))
    return SHAPES[int(np.argmax(overlaps))]


def read_colour(rgb: np.ndarray) -> str:
    """The named colour nearest to a mean foreground colour, compared as chromaticity (each colour divided by
    its brightest channel: a dim or blurred red is still red)."""
    chroma = rgb / max(float(rgb.max()), 1e-6)
    names = list(COLOURS)
    references = np.array([COLOURS[n] for n in names], dtype=np.float64)
    references /= references.max(axis=1, keepdims=True)
    return names[int(np.argmin(((references - chroma) ** 2).sum(axis=1)))]


def read_direction(xs: list[float], ys: list[float]) -> str | None:
    """The dominant axis and sign of the centroid's motion: the last half of the frames' mean position minus the
    first half's; None when it did not move."""
    half = len(xs) // 2
    dx = float(np.mean(xs[-half:]) - np.mean(xs[:half]))
    dy = float(np.mean(ys[-half:]) - np.mean(ys[:half]))
    if max(abs(dx), abs(dy)) < 0.5:
        return None
    if abs(dx) >= abs(dy):
        return "right" if dx > 0 else "left"
    return "down" if dy > 0 else "up"


def _majority(values: list[str]) -> str | None:
    if not values:
        return None
    names, counts = np.unique(values, return_counts=True)
    return str(names[int(np.argmax(counts))])


def check_clip(clip: np.ndarray) -> Reading:
    """Read one uint8 (T, H, W, 3) clip: colour and shape by majority over the frames where something is drawn,
    direction from the centroid's motion across those frames."""
    features = [_frame_features(frame) for frame in clip]
    seen = [f for f in features if f is not None]
    if len(seen) < 2:
        return Reading(None, None, None)
    colour = _majority([read_colour(f[0]) for f in seen])
    shape = _majority([f[1] for f in seen])
    return Reading(colour, shape, read_direction([f[2] for f in seen], [f[3] for f in seen]))


def check_clips(clips: np.ndarray | torch.Tensor) -> list[Reading]:
    """Readings of uint8 (N, T, H, W, 3) clips, or float (N, T, 3, H, W) ones in [-1, 1]."""
    if isinstance(clips, torch.Tensor):
        clips = to_uint8_clips(clips)
    return [check_clip(c) for c in clips]


def score(readings: list[Reading], specs: list[ClipSpec]) -> dict[str, float]:
    """Accuracy of colour, shape, direction and of all three at once against what each clip should show."""
    if len(readings) != len(specs):
        raise ValueError(f"{len(readings)} readings for {len(specs)} clips")
    if not specs:
        return {"colour": float("nan"), "shape": float("nan"), "direction": float("nan"), "all": float("nan"),
                "count": 0}
    hits = np.array([(r.colour == s.colour, r.shape == s.shape, r.direction == s.direction)
                     for r, s in zip(readings, specs)], dtype=np.float64)
    return {"colour": float(hits[:, 0].mean()), "shape": float(hits[:, 1].mean()),
            "direction": float(hits[:, 2].mean()), "all": float(hits.all(axis=1).mean()), "count": len(specs)}


CHANCE = {"colour": 1 / len(COLOURS), "shape": 1 / len(SHAPES), "direction": 1 / len(DIRECTIONS),
          "all": 1 / (len(COLOURS) * len(SHAPES) * len(DIRECTIONS))}
