"""The chat suite on a random decoder, an untrained tokenizer and an untrained classifier: every category is asked
and scored, the figures repeat for the same settings, a conversations file is answered as written, and the scoring
rules (exact text answers, the classifier's reading of image answers, wrong-modality rates) hold."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from PIL import Image

from evaluation import chat_data
from evaluation.base import EvalContext, EvalSettings
from evaluation.chat import ChatOptions, ChatSuite, normalise, score

SETTINGS = EvalSettings(seed=3, prompts_per_skill=3, batch_size=8, cfg_scale=1.0)


def _options(parts, **values) -> ChatOptions:
    base = parts[3]
    return ChatOptions(demo_dir=base.demo_dir, held_out=base.held_out, **values)


def _run(parts, family="chameleon", settings=SETTINGS, **options):
    vocab, tokenizer, families, _ = parts
    context = EvalContext(families[family], vocab, tokenizer, settings, progress=lambda line: None)
    suite = ChatSuite(_options(parts, **options))
    suite.check(context)
    return suite.run(context)


def test_every_category_is_asked_scored_and_repeats_for_the_same_settings(parts):
    first = _run(parts)
    figures = first.figures
    assert set(figures["categories"]) == set(chat_data.CATEGORIES)
    for category, row in figures["categories"].items():
        assert row["count"] == SETTINGS.prompts_per_skill and 0 <= row["accuracy"] <= 1, category
    assert len(figures["answers"]) == len(chat_data.CATEGORIES) * SETTINGS.prompts_per_skill
    assert figures["generated_tokens"] > 0
    for key in ("mean_accuracy", "image_when_none_asked", "text_only_when_image_asked"):
        assert 0 <= figures[key] <= 1
    assert {s.group for s in first.samples} == set(chat_data.CATEGORIES)
    assert _run(parts).figures == figures
    assert _run(parts, settings=dataclasses.replace(SETTINGS, seed=4)).figures["answers"] != figures["answers"]


def test_a_conversations_file_is_answered_as_written(parts, tmp_path):
    rng = np.random.default_rng(0)
    labels = np.arange(20) % 10
    pictures = {"held_out": rng.integers(0, 255, size=(20, 64, 64, 3), dtype=np.uint8)}
    conversations = chat_data.make_conversations(labels, {"visual_chat": 2, "text_only": 1, "interleaved": 1},
                                                 "held_out", rng)
    path = chat_data.write_split(tmp_path, "held_out", conversations, pictures)
    suite = ChatSuite(_options(parts, conversations=str(path)))
    vocab, tokenizer, families, _ = parts
    read, user_parts = suite.conversations(EvalContext(families["chameleon"], vocab, tokenizer, SETTINGS))
    assert read == conversations
    for c, given in zip(conversations, user_parts):
        images = [p for p in given if isinstance(p, Image.Image)]
        assert len(images) == (c.category in ("visual_chat", "interleaved"))
        if images:  # the very picture written for this conversation
            assert np.array_equal(np.asarray(images[0]), pictures["held_out"][c.user_image])
    figures = _run(parts, conversations=str(path)).figures
    assert {c: r["count"] for c, r in figures["categories"].items()} == {"visual_chat": 2, "interleaved": 1,
                                                                         "text_only": 1}


def test_a_family_that_writes_no_images_answers_in_text(parts):
    figures = _run(parts, "llava").figures
    assert figures["text_only_when_image_asked"] == 1.0
    assert all(figures["categories"][c]["accuracy"] == 0.0 for c in ("image_generation", "interleaved"))


def test_missing_inputs_are_refused_in_one_sentence(parts, tmp_path):
    vocab, tokenizer, families, _ = parts
    context = EvalContext(families["chameleon"], vocab, tokenizer, SETTINGS)
    with pytest.raises(FileNotFoundError, match="classifier"):
        ChatSuite(ChatOptions(demo_dir=str(tmp_path))).check(context)
    with pytest.raises(ValueError, match="--demo-dir"):
        ChatSuite(ChatOptions()).check(context)
    with pytest.raises(FileNotFoundError, match="--conversations"):
        ChatSuite(_options(parts, conversations=str(tmp_path / "held_out.jsonl"))).check(context)
    with pytest.raises(ValueError, match="--media-tokenizer"):
        ChatSuite(_options(parts)).check(EvalContext(families["chameleon"], vocab, None, SETTINGS))


def _answer(text: str = "", image: bool = False) -> dict:
    return {"text": text, "after_image": text if image else "", "image": Image.new("RGB", (2, 2)) if image else None,
            "opened_image": image}


def test_score_rules():
    c = chat_data.Conversation
    conversations = [c("visual_chat", 7, 7, "held_out", 0, -1), c("visual_chat", 3, 3, "held_out", 1, -1),
                     c("text_only", 3, 4, "held_out", -1, -1), c("image_generation", 5, 5, "held_out", -1, 2),
                     c("interleaved", 9, 0, "held_out", 3, 4), c("interleaved", 1, 2, "held_out", 5, 6)]
    answers = [_answer(" Seven."), _answer("three", image=True), _answer("the number four"),
               _answer("five"), _answer("That is a zero.", image=True), _answer("That is a two.", image=True)]
    predicted = [None, 3, None, None, 0, 5]
    scores = score(conversations, answers, predicted)
    per = scores["categories"]
    # exact match after case, spaces and a full stop; an answer with an image is never a right text answer
    assert per["visual_chat"]["accuracy"] == 0.5 and per["visual_chat"]["image_when_none_asked"] == 0.5
    assert per["text_only"]["accuracy"] == 0.0 and per["text_only"]["names_answer"] == 1.0
    assert per["image_generation"]["accuracy"] == 0.0 and per["image_generation"]["text_only_when_image_asked"] == 1.0
    assert per["interleaved"]["accuracy"] == 0.5 and per["interleaved"]["sentence_accuracy"] == 1.0
    assert per["interleaved"]["image_and_sentence"] == 0.5
    assert scores["image_when_none_asked"] == pytest.approx(1 / 3)
    assert scores["text_only_when_image_asked"] == pytest.approx(1 / 3)
    assert normalise(" Seven. ") == "seven"
