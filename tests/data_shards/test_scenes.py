"""The scene world: prompts and scenes, the held-out caption split (never written by training, every word pair still
trained), questions whose answers parse back, deterministic training documents, and `shards write --demo scenes`."""

from __future__ import annotations

import io
import itertools

import numpy as np
import pytest
from PIL import Image

from data_shards import scenes as world
from data_shards.raw import iter_raw_shard, read_raw_manifest


def test_every_skill_enumerates_distinct_captions_that_parse_back():
    counts = {skill: len(world.prompts(skill)) for skill in world.SKILLS}
    assert counts == {"single_object": 3, "two_objects": 6, "counting": 12, "colours": 12, "position": 24,
                      "colour_attribution": 96}
    captions = [p.caption for s in world.SKILLS for p in world.prompts(s)]
    assert len(set(captions)) == len(captions)
    assert world.prompt_for("counting", ("one", "square")).caption == "one square"
    assert world.prompt_for("counting", ("three", "circle")).caption == "three circles"
    assert world.prompt_for("position", ("square", "above", "circle")).caption == "a square above a circle"
    for skill in world.SKILLS:
        for prompt in world.prompts(skill):
            assert world.parse_caption(prompt.caption) == prompt
    assert world.parse_caption("a purple square") is None
    with pytest.raises(ValueError, match="not a combination"):
        world.prompt_for("two_objects", ("square", "square"))


@pytest.mark.parametrize("skill", world.SKILLS)
def test_scenes_of_a_prompt_show_exactly_what_it_names(skill):
    rng = np.random.default_rng(1)
    for prompt in world.prompts(skill)[:12]:
        scene = world.scene_for(prompt, rng)
        quadrants = [o.quadrant for o in scene.objects]
        assert len(set(quadrants)) == len(quadrants)
        for obj in scene.objects:  # the box stays inside its quadrant, so objects never touch
            assert world.MIN_SIDE <= obj.side <= world.MAX_SIDE
            assert world.quadrant_of(obj.cx - obj.side / 2, obj.cy - obj.side / 2) == obj.quadrant
            assert world.quadrant_of(obj.cx + obj.side / 2 - 1e-6, obj.cy + obj.side / 2 - 1e-6) == obj.quadrant
        shapes = [o.shape for o in scene.objects]
        if skill == "counting":
            assert shapes == [prompt.shapes[0]] * prompt.count
        else:
            assert sorted(shapes) == sorted(prompt.shapes)
            named = {(c, s) for c, s in zip(prompt.colours, prompt.shapes) if c is not None}
            assert named <= {(o.colour, o.shape) for o in scene.objects}
        if skill == "position":
            first = next(o for o in scene.objects if o.shape == prompt.shapes[0])
            second = next(o for o in scene.objects if o.shape == prompt.shapes[1])
            row, col = (first.quadrant // 2, second.quadrant // 2), (first.quadrant % 2, second.quadrant % 2)
            expected = {"left of": (row[0] == row[1] and col == (0, 1)), "right of": (row[0] == row[1] and col == (1, 0)),
                        "above": (col[0] == col[1] and row == (0, 1)), "below": (col[0] == col[1] and row == (1, 0))}
            assert expected[prompt.relation]
    image = world.render(scene)
    assert image.dtype == np.uint8 and image.shape == (64, 64, 3)
    assert (image[0, 0] == world.BACKGROUND).all()


def _caption_documents(count: int, seed: int = 0) -> list[str]:
    return [s.segments[0] for s in world.training_samples(count, seed) if s.key.endswith("_caption")]


def test_held_out_captions_are_never_written_and_their_word_pairs_are_trained():
    held = world.held_out_captions(seed=0)
    sizes = {skill: len(captions) for skill, captions in held.items()}
    assert sizes["single_object"] == 0
    for skill in world.SKILLS[1:]:
        share = sizes[skill] / len(world.combinations(skill))
        assert 0.15 <= share <= 0.25, (skill, sizes[skill])
    written = _caption_documents(1500)
    held_all = {c for captions in held.values() for c in captions}
    assert written and not set(written) & held_all
    assert {world.parse_caption(c).skill for c in written} == set(world.SKILLS)
    # nor does any other training text equal a held-out caption
    texts = {t for s in world.training_samples(300) for t in s.segments if isinstance(t, str)}
    assert not {t.strip() for t in texts} & held_all
    # every pair of slot words (two-slot captions: every word in its slot) is in a written caption of the skill
    trained = [world.parse_caption(c) for c in set(written)]
    for skill, captions in held.items():
        seen_pairs, seen_words = set(), set()
        for p in trained:
            if p.skill == skill:
                slots = list(enumerate(p.combination))
                seen_pairs |= set(itertools.combinations(slots, 2))
                seen_words |= set(slots)
        for caption in captions:
            slots = list(enumerate(world.parse_caption(caption).combination))
            assert set(slots) <= seen_words, caption
            if len(slots) >= 3:
                assert set(itertools.combinations(slots, 2)) <= seen_pairs, caption
    assert world.held_out_captions(seed=0) == held and world.held_out_captions(seed=1) != held


def test_evaluation_prompts_come_from_held_out_captions_and_trained_single_objects():
    held = world.held_out_captions(seed=0)
    prompts = world.evaluation_prompts(per_skill=7, seed=5)
    assert len(prompts) == 7 * len(world.SKILLS)
    for prompt in prompts:
        if prompt.skill == "single_object":
            assert prompt in world.training_prompts("single_object")
        else:
            assert prompt.caption in held[prompt.skill]
    assert world.evaluation_prompts(per_skill=7, seed=5) == prompts


def test_training_documents_are_deterministic_keyed_and_shaped():
    first = list(world.training_samples(120, seed=3))
    again = list(world.training_samples(60, seed=3))  # a prefix is the same whatever the count
    assert [s.key for s in first[:60]] == [s.key for s in again]
    for a, b in zip(first[:60], again):
        assert [np.asarray(x).tobytes() if isinstance(x, Image.Image) else x for x in a.segments] == \
               [np.asarray(x).tobytes() if isinstance(x, Image.Image) else x for x in b.segments]
    assert len({s.key for s in first}) == len(first)
    assert [s.key for s in world.training_samples(5, seed=4)] != [s.key for s in first[:5]]
    kinds = {s.key.rsplit("_", 1)[1] for s in first}
    assert kinds == {"caption", "question", "edit"}
    for sample in first:
        kind = sample.key.rsplit("_", 1)[1]
        types = [type(x).__name__ for x in sample.segments]
        if kind == "caption":  # a 2-segment [text, image] pair: the tokenizer may flip it
            assert types == ["str", "Image"]
        elif kind == "question":  # three segments: never flipped
            image, question, answer = sample.segments
            assert types == ["Image", "str", "str"] and answer.startswith(" ")
        else:
            assert types == ["Image", "str", "Image"] and sample.segments[1].startswith("add a ")


def test_questions_answer_from_the_scene_and_parse_back():
    items = world.understanding_items(30, seed=2)
    assert {q.kind for q in items} == set(world.QUESTION_KINDS)
    for item in items:
        assert world.parse_answer(item.kind, f" {item.answer}") == item.answer
        assert world.parse_answer(item.kind, f"It is {item.answer.upper()}.") == item.answer
        if item.kind == "count":
            assert item.question == world.COUNT_QUESTION
            assert item.answer == world.NUMBERS[len(item.scene.objects) - 1]
        elif item.kind == "colour":
            shape = item.question.removeprefix("what colour is the ").removesuffix("?")
            [obj] = [o for o in item.scene.objects if o.shape == shape]
            assert obj.colour == item.answer
        else:
            assert item.answer in world.QUADRANTS
    assert world.understanding_items(30, seed=2) == items
    assert world.parse_answer("position", "top-right, I think") == "top right"
    assert world.parse_answer("count", "3") == "three"
    assert world.parse_answer("colour", "purple") is None
    # evaluation scenes come from a stream training never draws: none equals a training document's scene
    train_scene_images = {np.asarray(s.segments[0]).tobytes() for s in world.training_samples(200)
                          if s.key.endswith("_question")}
    assert not {world.render(q.scene).tobytes() for q in items} & train_scene_images


def test_held_out_text_documents_are_held_out_captions():
    docs = world.held_out_text_documents(40, seed=0)
    held = {c for captions in world.held_out_captions().values() for c in captions}
    assert len(docs) == 40 and docs == world.held_out_text_documents(40, seed=0) != world.held_out_text_documents(40, 1)
    assert set(docs) <= held and len(set(docs)) > 10


def test_shards_write_demo_scenes_end_to_end(tmp_path):
    from fusion_model.cli import main

    assert main(["shards", "write", "--demo", "scenes", "--demo-limit", "24", "--out", str(tmp_path / "raw")]) == 0
    manifest = read_raw_manifest(tmp_path / "raw")
    assert manifest["documents"] == 24
    docs = {}
    for shard in manifest["shards"]:
        docs.update(iter_raw_shard(tmp_path / "raw" / shard["name"]))
    expected = list(world.training_samples(24, seed=0))
    assert sorted(docs) == sorted(s.key for s in expected)
    for sample in expected:
        stored = docs[sample.key]
        assert len(stored) == len(sample.segments)
        for kept, original in zip(stored, sample.segments):
            if isinstance(original, str):
                assert kept == original
            else:
                assert np.array_equal(np.asarray(Image.open(io.BytesIO(kept[1])).convert("RGB")),
                                      np.asarray(original))
