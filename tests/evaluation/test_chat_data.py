"""The chat conversations (the chat suite asks them, the SFT experiment trains on them): splits kept apart, category counts, right answers, parseable JSONL."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from PIL import Image

from evaluation import chat_data
from evaluation.digits_data import DIGIT_WORDS, parse_digit
from tokenizer.chat import parse_messages

TRAIN, HELD_OUT = 120, 40


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """Conversations written from synthetic digits: each picture's pixels encode its split and index."""
    rng = np.random.default_rng(1)
    labels = {"train": rng.integers(0, 10, TRAIN), "held_out": rng.integers(0, 10, HELD_OUT)}
    labels["train"][:10] = labels["held_out"][:10] = np.arange(10)  # every digit in both splits
    pictures = {}
    for tag, (split, n) in enumerate((("train", TRAIN), ("held_out", HELD_OUT))):
        grid = np.zeros((n, 8, 8), dtype=np.uint8)
        grid[:, 0, 0] = tag  # the split, then the index in two bytes: a picture is never another split's
        grid[:, 0, 1], grid[:, 0, 2] = np.arange(n) // 256, np.arange(n) % 256
        pictures[split] = grid
    folder = tmp_path_factory.mktemp("chat")
    data = chat_data.write_chat_data(folder, labels["train"], labels["held_out"], pictures, train_conversations=202,
                                    held_out_per_category=7, seed=3)
    return data, labels, pictures


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _image_paths(path):
    return [part["path"] for record in _records(path) for message in record["messages"]
            for part in message["content"] if part["type"] == "image"]


def test_held_out_digits_never_appear_in_training_conversations(written):
    data, labels, pictures = written
    held_out_pixels = {pictures["held_out"][i].tobytes() for i in range(HELD_OUT)}
    for split in (data.train, data.train_unbalanced):
        paths = _image_paths(split)
        assert paths and all(p.startswith("images/train_") for p in paths)
        for p in set(paths):
            pixels = np.asarray(Image.open(data.folder / p))
            assert pixels.tobytes() not in held_out_pixels
        assert all(c.split == "train" for c in chat_data.read_labels(data.folder, split.stem))
    assert all(p.startswith("images/held_out_") for p in _image_paths(data.held_out))


def test_category_counts(written):
    data, _, _ = written
    count = lambda name: {c: sum(x.category == c for x in chat_data.read_labels(data.folder, name))  # noqa: E731
                          for c in chat_data.CATEGORIES}
    balanced, unbalanced, held_out = count("train"), count("train_unbalanced"), count("held_out")
    assert sum(balanced.values()) == sum(unbalanced.values()) == 202
    assert max(balanced.values()) - min(balanced.values()) <= 1
    assert unbalanced == chat_data.category_counts(202, chat_data.UNBALANCED_MIX)
    assert unbalanced["visual_chat"] > 8 * unbalanced["image_generation"]
    assert held_out == dict.fromkeys(chat_data.CATEGORIES, 7)
    assert chat_data.category_counts(10) == {"visual_chat": 3, "image_generation": 3, "interleaved": 2,
                                            "text_only": 2}
    with pytest.raises(ValueError, match="mix"):
        chat_data.category_counts(10, {"visual_chat": -1.0})


def test_every_answer_is_right(written):
    data, labels, pictures = written

    def label_of(path: str) -> int:
        split, index = re.fullmatch(r"images/(train|held_out)_(\d+)\.png", path).groups()
        pixels = np.asarray(Image.open(data.folder / path))
        assert pixels.tobytes() == pictures[split][int(index)].tobytes()  # the file is that digit
        return int(labels[split][int(index)])

    for name in ("train", "train_unbalanced", "held_out"):
        for record, c in zip(_records(data.folder / f"{name}.jsonl"), chat_data.read_labels(data.folder, name)):
            user, assistant = record["messages"]
            assert (user["role"], assistant["role"]) == ("user", "assistant")
            asked = [p for p in user["content"] if p["type"] == "image"]
            answer_images = [p for p in assistant["content"] if p["type"] == "image"]
            answer_text = " ".join(p["text"] for p in assistant["content"] if p["type"] == "text")
            question = " ".join(p["text"] for p in user["content"] if p["type"] == "text")
            assert bool(answer_images) == chat_data.ASKS_FOR_IMAGE[c.category]
            if c.category == "visual_chat":
                assert answer_text == DIGIT_WORDS[label_of(asked[0]["path"])] == DIGIT_WORDS[c.answer]
            elif c.category == "image_generation":
                assert not asked and label_of(answer_images[0]["path"]) == parse_digit(question) == c.answer
            elif c.category == "interleaved":
                shown = label_of(asked[0]["path"])
                assert label_of(answer_images[0]["path"]) == (shown + 1) % 10 == c.answer
                assert assistant["content"][0]["type"] == "image"  # the image first, then the sentence
                assert answer_text == f"That is a {DIGIT_WORDS[c.answer]}."
            else:
                assert not asked and answer_text == DIGIT_WORDS[(parse_digit(question) + 1) % 10]
                assert c.answer == (c.digit + 1) % 10
    assert chat_data.next_digit(9) == 0


def test_jsonl_parses_as_chat_and_its_images_exist(written):
    data, _, _ = written
    for path in (data.train, data.train_unbalanced, data.held_out):
        records = _records(path)
        for number, record in enumerate(records):
            turns = parse_messages(record, f"{path}:{number + 1}")
            assert [t.role for t in turns] == ["user", "assistant"]
            for turn in turns:
                for part in turn.parts:
                    if part.startswith("images/"):
                        assert (path.parent / part).is_file()


def test_the_same_seed_writes_the_same_files(written, tmp_path):
    data, labels, pictures = written
    again = chat_data.write_chat_data(tmp_path, labels["train"], labels["held_out"], pictures,
                                     train_conversations=202, held_out_per_category=7, seed=3)
    for name in ("train", "train_unbalanced", "held_out"):
        assert (tmp_path / f"{name}.jsonl").read_text() == (data.folder / f"{name}.jsonl").read_text()
    assert again.held_out.name == "held_out.jsonl"
