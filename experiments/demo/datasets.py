"""The demo's offline data: MNIST digits (train / held-out split), their captions, and arithmetic documents."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

# the definitions the `digits` suite scores with live one layer down (evaluation.digits_data); re-exported here
from evaluation.digits_data import (  # noqa: F401
    CALCULATE,
    CAPTION_TEMPLATES,
    DIGIT_WORDS,
    EQUALS,
    PLUS,
    DigitSplit,
    arithmetic_pairs,
    caption,
    caption_prompt,
    load_digits,
    parse_digit,
    pick_by_label,
    to_model_images,
    worded_sum,
)


def augment_digits(digits: np.ndarray, rng: np.random.Generator, rotation: float = 12.0, scale: float = 0.1,
                   shift: float = 2.0) -> np.ndarray:
    """A randomly rotated (degrees), scaled and shifted (pixels) copy of each uint8 digit (N, 28, 28).

    Training digits are written several times; each copy differs, so the decoder sees more distinct code grids
    per digit and generalises to held-out digits better (the held-out ones are never augmented).
    """
    n, side = digits.shape[0], digits.shape[-1]
    angle = np.deg2rad(rng.uniform(-rotation, rotation, n))
    zoom = rng.uniform(1.0 - scale, 1.0 + scale, n)
    offset = rng.uniform(-shift, shift, (n, 2)) * 2.0 / side  # pixels -> affine_grid's [-1, 1] units
    cos, sin = np.cos(angle) / zoom, np.sin(angle) / zoom
    theta = torch.tensor(np.stack([np.stack([cos, -sin, offset[:, 0]], 1), np.stack([sin, cos, offset[:, 1]], 1)], 1),
                         dtype=torch.float32)
    x = torch.as_tensor(digits, dtype=torch.float32).unsqueeze(1)
    grid = F.affine_grid(theta, list(x.shape), align_corners=False)
    out = F.grid_sample(x, grid, mode="bilinear", padding_mode="zeros", align_corners=False)
    return out.squeeze(1).round().clamp(0, 255).to(torch.uint8).numpy()




def caption_document(label: int, variant: int, image) -> list:
    """A captioned digit as the demo writes it: the caption, then the image (pre-tokenizing flips some of them)."""
    return [caption(label, variant), image]


def arithmetic_document(a_image, b_image, c_image, a: int, b: int) -> list:
    """"calculate <a> plus <b> equals: a plus b is c <c>", the images given and a, b their digits (see CALCULATE)."""
    return [CALCULATE, a_image, PLUS, b_image, EQUALS + worded_sum(a, b), c_image]








def caption_texts() -> list[str]:
    """Every caption phrasing for every digit, and the arithmetic words (for training the vocabulary)."""
    texts = [caption(d, v) for d in range(10) for v in range(len(CAPTION_TEMPLATES))]
    # the arithmetic words stand alone between two images in the documents
    sums = [worded_sum(a, b) for a in range(10) for b in range(10 - a)]
    return texts + [CALCULATE, PLUS, EQUALS] * 10 + sums


def vocab_corpus(english: list[str]) -> list[str]:
    """The demo's vocabulary corpus: the English lines, then the captions repeated to about a third of the characters,
    so that their words become single tokens even in a small vocabulary (short sequences train faster and caption in
    fewer steps)."""
    captions = caption_texts()
    repeat = max(1, sum(map(len, english)) // (2 * sum(map(len, captions))))
    return english + captions * repeat



