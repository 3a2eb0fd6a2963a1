"""Chat conversations about the demo's MNIST digits in four categories, seeded: what the `chat` suite asks
(held-out digits) and what the SFT experiment trains on (training digits).

Categories (each answer is exact to score):
- `visual_chat`: user `<image> Which digit is this?` -> assistant the digit's name ("seven");
- `image_generation`: user "Draw a seven." -> assistant an image of a seven;
- `interleaved`: user "Here is a digit: <image> Draw the one after it." -> assistant an image of the next digit
  (nine -> zero), then "That is a eight." (the demo's caption wording: "this is a {word}");
- `text_only`: user "What comes after three?" -> assistant "four".

Training conversations use training digits only, held-out ones held-out digits only; the images are written once
each as 64-px PNGs (the tokenizer's size, so `shards write` resizes nothing) under `images/`, and each split is a
JSONL in the chat-messages convention (`tokenizer.chat.parse_messages`), with paths relative to its folder. What
each conversation asks and the right answer sit beside it in `<name>.labels.json` (the JSONL stays pure chat).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from common.files import atomic_write_json, atomic_write_text
from evaluation.digits_data import DIGIT_WORDS, pick_by_label

CATEGORIES = ("visual_chat", "image_generation", "interleaved", "text_only")
# which categories' answers are an image (the rest answer in text only)
ASKS_FOR_IMAGE = {"visual_chat": False, "image_generation": True, "interleaved": True, "text_only": False}
QUESTION = "Which digit is this?"
DRAW = "Draw a {word}."
HERE, DRAW_NEXT = "Here is a digit:", "Draw the one after it."
AFTER = "What comes after {word}?"
SENTENCE = "That is a {word}."  # the demo's captions say "this is a {word}" (its BPE has the words), "a eight" too
# the unbalanced arm's mix: mostly text answers, few image answers (Chameleon's SFT balances its categories)
UNBALANCED_MIX = {"visual_chat": 0.45, "image_generation": 0.05, "interleaved": 0.05, "text_only": 0.45}


@dataclass(frozen=True)
class Conversation:
    """One conversation: its category, the digit it is about, the right answer digit, and its images as
    (split, index) into the digits of that split: the user's image (or -1) and the reference answer image (or -1)."""

    category: str
    digit: int  # the digit shown (visual_chat, interleaved) or named (image_generation, text_only)
    answer: int  # the digit the answer must name or draw
    split: str  # "train" or "held_out": where both images come from
    user_image: int  # index into the split's digits, -1 for none
    answer_image: int  # index into the split's digits, -1 for none


def next_digit(digit: int) -> int:
    """The digit after `digit`, nine wrapping round to zero."""
    return (int(digit) + 1) % 10


def answer_digit(category: str, digit: int) -> int:
    """The digit the right answer names or draws."""
    return int(digit) if category in ("visual_chat", "image_generation") else next_digit(digit)


def category_counts(total: int, mix: Mapping[str, float] | None = None) -> dict[str, int]:
    """Conversations per category for `total` in all: equal shares, or `mix`'s (largest remainders round)."""
    weights = np.array([float((mix or {}).get(c, 1.0 if mix is None else 0.0)) for c in CATEGORIES])
    if weights.sum() <= 0 or (weights < 0).any():
        raise ValueError(f"category mix {dict(mix or {})} needs non-negative shares of {CATEGORIES} summing above 0")
    exact = total * weights / weights.sum()
    counts = np.floor(exact).astype(int)
    for i in np.argsort(-(exact - counts), kind="stable")[: total - counts.sum()]:
        counts[i] += 1
    return {c: int(n) for c, n in zip(CATEGORIES, counts)}


def make_conversations(labels: np.ndarray, counts: Mapping[str, int], split: str,
                       rng: np.random.Generator) -> list[Conversation]:
    """`counts[category]` conversations of each category about digits of one split (labels of its images),
    digits drawn uniformly, images drawn at random among that split's examples of the digit; shuffled."""
    conversations: list[Conversation] = []
    for category in CATEGORIES:
        n = int(counts.get(category, 0))
        if n <= 0:
            continue
        digits = rng.integers(0, 10, size=n)
        answers = np.array([answer_digit(category, d) for d in digits])
        shown = pick_by_label(labels, digits, rng) if category in ("visual_chat", "interleaved") else None
        drawn = pick_by_label(labels, answers, rng) if ASKS_FOR_IMAGE[category] else None
        for i in range(n):
            conversations.append(Conversation(
                category, int(digits[i]), int(answers[i]), split,
                int(shown[i]) if shown is not None else -1, int(drawn[i]) if drawn is not None else -1))
    order = rng.permutation(len(conversations))
    return [conversations[i] for i in order]


def image_name(split: str, index: int) -> str:
    """The PNG of one digit, relative to the conversations' folder."""
    return f"images/{split}_{index:05d}.png"


def user_parts(conversation: Conversation) -> list:
    """The user turn's parts: text, and the image's relative path as a `Path` (an image part)."""
    c = conversation
    if c.category == "visual_chat":
        return [Path(image_name(c.split, c.user_image)), QUESTION]
    if c.category == "image_generation":
        return [DRAW.format(word=DIGIT_WORDS[c.digit])]
    if c.category == "interleaved":
        return [HERE, Path(image_name(c.split, c.user_image)), DRAW_NEXT]
    if c.category == "text_only":
        return [AFTER.format(word=DIGIT_WORDS[c.digit])]
    raise ValueError(f"unknown category {c.category!r}; categories are {CATEGORIES}")


def assistant_parts(conversation: Conversation) -> list:
    """The right answer's parts (an image as its relative path, a `Path`)."""
    c = conversation
    word = DIGIT_WORDS[c.answer]
    if c.category in ("visual_chat", "text_only"):
        return [word]
    if c.category == "image_generation":
        return [Path(image_name(c.split, c.answer_image))]
    return [Path(image_name(c.split, c.answer_image)), SENTENCE.format(word=word)]


def _content(parts: Sequence) -> list[dict]:
    """Chat-messages content: text parts and image parts with paths."""
    return [{"type": "image", "path": str(p)} if isinstance(p, Path) else {"type": "text", "text": p}
            for p in parts]


def chat_record(conversation: Conversation, with_answer: bool = True) -> dict:
    """The conversation as one chat-messages record (without the assistant turn: the prompt only)."""
    messages = [{"role": "user", "content": _content(user_parts(conversation))}]
    if with_answer:
        messages.append({"role": "assistant", "content": _content(assistant_parts(conversation))})
    return {"messages": messages}


def images_used(conversations: Sequence[Conversation]) -> set[tuple[str, int]]:
    """Every (split, index) image the conversations show or answer with."""
    return {(c.split, i) for c in conversations for i in (c.user_image, c.answer_image) if i >= 0}


def write_images(folder: Path, used: set[tuple[str, int]], pictures: Mapping[str, np.ndarray]) -> None:
    """Each used image once, as a PNG (pictures[split]: uint8 (N, H, W, 3) or (N, H, W))."""
    from PIL import Image

    (folder / "images").mkdir(parents=True, exist_ok=True)
    for split, index in sorted(used):
        path = folder / image_name(split, index)
        if not path.is_file():  # splits share the folder; an image is the same picture whichever file asks
            Image.fromarray(np.asarray(pictures[split][index])).save(path)


def write_split(folder: Path, name: str, conversations: Sequence[Conversation],
                pictures: Mapping[str, np.ndarray]) -> Path:
    """`<folder>/<name>.jsonl` (one chat record a line), `<name>.labels.json` and the images; returns the JSONL."""
    folder.mkdir(parents=True, exist_ok=True)
    write_images(folder, images_used(conversations), pictures)
    lines = "".join(json.dumps(chat_record(c)) + "\n" for c in conversations)
    path = folder / f"{name}.jsonl"
    atomic_write_text(path, lines)
    atomic_write_json(folder / f"{name}.labels.json", [asdict(c) for c in conversations])
    return path


def read_labels(folder: Path, name: str) -> list[Conversation]:
    """The conversations `write_split` wrote as `<name>`."""
    return [Conversation(**row) for row in json.loads((folder / f"{name}.labels.json").read_text())]


@dataclass(frozen=True)
class ChatData:
    """The experiment's conversation files: the balanced and unbalanced training JSONLs and the held-out one."""

    folder: Path
    train: Path
    train_unbalanced: Path
    held_out: Path


def write_chat_data(folder: Path, train_labels: np.ndarray, held_out_labels: np.ndarray,
                    pictures: Mapping[str, np.ndarray], *, train_conversations: int, held_out_per_category: int,
                    seed: int, mix: Mapping[str, float] | None = None) -> ChatData:
    """Write the three splits: `train` (equal categories), `train_unbalanced` (the same number of conversations in
    `mix`'s shares, default UNBALANCED_MIX) from training digits, and `held_out` (`held_out_per_category` of each)
    from held-out digits. Seeded: the same arguments write the same files."""
    rng = np.random.default_rng(seed)
    train = make_conversations(train_labels, category_counts(train_conversations), "train", rng)
    unbalanced = make_conversations(train_labels, category_counts(train_conversations, mix or UNBALANCED_MIX),
                                    "train", rng)
    held_out = make_conversations(held_out_labels, {c: held_out_per_category for c in CATEGORIES}, "held_out", rng)
    return ChatData(folder, write_split(folder, "train", train, pictures),
                    write_split(folder, "train_unbalanced", unbalanced, pictures),
                    write_split(folder, "held_out", held_out, pictures))
