"""The clip world of the `clips` suite: its seeded synthetic clips and its independent checker (evaluation.clip_world)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from evaluation import clip_world as v


@pytest.fixture(scope="module")
def split():
    return v.make_split(train=192, held_out=96, novel=48, novel_triples=6, seed=0)


def test_clips_are_seeded_and_shaped(split):
    again = v.make_split(train=192, held_out=96, novel=48, novel_triples=6, seed=0)
    assert np.array_equal(again.train.clips, split.train.clips) and again.novel_triples == split.novel_triples
    other = v.make_split(train=192, held_out=96, novel=48, novel_triples=6, seed=1)
    assert not np.array_equal(other.train.clips, split.train.clips)
    assert split.train.clips.shape == (192, v.FRAMES, v.SIZE, v.SIZE, 3) and split.train.clips.dtype == np.uint8
    assert split.train.captions[0].startswith("a ") and " moving " in split.train.captions[0]


def test_held_out_triples_are_never_trained_but_their_word_pairs_are(split):
    train_triples = {s.triple for s in split.train.specs}
    assert len(split.novel_triples) == 6
    assert not train_triples & set(split.novel_triples)
    assert {s.triple for s in split.novel.specs} == set(split.novel_triples)
    assert {s.triple for s in split.held_out.specs} <= train_triples
    for triple in split.novel_triples:
        for i, j in ((0, 1), (0, 2), (1, 2)):
            assert any(t[i] == triple[i] and t[j] == triple[j] for t in train_triples), (triple, i, j)
    # every trained triple is shown (the clips cycle through them)
    assert len(train_triples) == len(v.all_triples()) - 6


def test_shapes_stay_inside_the_frame_and_move(split):
    for clip, spec in zip(split.train.clips[:48], split.train.specs[:48]):
        assert all(frame.max() > 200 for frame in clip), spec  # drawn in every frame
        # nothing is cut at the border: the shape's coverage is the same in the first and last frame
        areas = (clip.max(axis=-1) > 0).sum(axis=(1, 2))
        assert abs(int(areas[0]) - int(areas[-1])) <= 0.15 * areas[0] + 4, spec


def test_the_checker_reads_ground_truth_clips(split):
    for clips in (split.train, split.held_out, split.novel):
        scores = v.score(v.check_clips(clips.clips), clips.specs)
        assert scores["all"] == 1.0, scores
    # the float form the tokenizers use reads the same
    readings = v.check_clips(v.to_model_clips(split.held_out.clips))
    assert v.score(readings, split.held_out.specs)["all"] == 1.0


def test_the_checker_survives_mild_blur_and_noise(split):
    clips = v.to_model_clips(split.held_out.clips)
    generator = torch.Generator().manual_seed(0)
    blurred = torch.nn.functional.avg_pool2d(clips.flatten(0, 1), 3, 1, 1).view_as(clips)
    noisy = blurred + 0.05 * torch.randn(clips.shape, generator=generator)
    scores = v.score(v.check_clips(noisy), split.held_out.specs)
    assert scores["colour"] == 1.0 and scores["direction"] == 1.0 and scores["shape"] >= 0.8, scores


def test_the_checker_says_nothing_about_an_empty_clip_and_is_not_fooled_by_reversal(split):
    empty = np.zeros((v.FRAMES, v.SIZE, v.SIZE, 3), np.uint8)
    assert v.check_clip(empty) == v.Reading(None, None, None)
    opposite = {"left": "right", "right": "left", "up": "down", "down": "up"}
    for clip, spec in zip(split.held_out.clips[:12], split.held_out.specs[:12]):
        assert v.check_clip(clip[::-1]).direction == opposite[spec.direction]
        still = np.repeat(clip[:1], v.FRAMES, axis=0)
        assert v.check_clip(still).direction is None  # a frozen clip has no direction: scored wrong


def test_score_and_conversions():
    specs = [v.ClipSpec("red", "square", "left", 10, 10, 10, 1.5), v.ClipSpec("blue", "circle", "up", 10, 10, 10, 1.5)]
    readings = [v.Reading("red", "square", "left"), v.Reading("blue", "square", None)]
    assert v.score(readings, specs) == {"colour": 1.0, "shape": 0.5, "direction": 0.5, "all": 0.5, "count": 2}
    with pytest.raises(ValueError, match="readings"):
        v.score(readings[:1], specs)
    clip = v.render(specs[0])[None]
    assert np.array_equal(v.to_uint8_clips(v.to_model_clips(clip)), clip)
    assert v.CHANCE["direction"] == 0.25
