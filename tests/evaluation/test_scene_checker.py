"""The scene checker reads the world's own renders (>= 99% per skill), still reads blurred noisy ones (as a VQ
reconstruction is), rejects pictures of other prompts, and maps pictures to full-rank continuous features."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from data_shards import scenes as world
from evaluation import scene_checker as checker

PER_SKILL = 100


def _blurred(image: np.ndarray, rng: np.random.Generator, sigma: float = 6.0) -> np.ndarray:
    """A 3x3 box blur plus Gaussian noise of `sigma` grey levels: about what a VQ reconstruction does to edges."""
    padded = np.pad(image.astype(np.float64), ((1, 1), (1, 1), (0, 0)), mode="edge")
    h, w = image.shape[:2]
    blurred = sum(padded[i:i + h, j:j + w] for i in range(3) for j in range(3)) / 9
    return np.clip(blurred + rng.normal(0.0, sigma, blurred.shape), 0, 255).round().astype(np.uint8)


def _requirement(prompt: world.Prompt) -> tuple:
    """What a prompt asks, whatever its wording ("a square left of a circle" = "a circle right of a square")."""
    shapes, relation = prompt.shapes, prompt.relation
    if relation in ("right of", "below"):
        shapes, relation = shapes[::-1], {"right of": "left of", "below": "above"}[relation]
    return frozenset(zip(prompt.colours, prompt.shapes)), shapes if relation else None, prompt.count, relation


def _prompts(skill: str, count: int, rng: np.random.Generator) -> list[world.Prompt]:
    pool = world.prompts(skill)
    return [pool[int(i)] for i in rng.integers(len(pool), size=count)]


@pytest.mark.parametrize("skill", world.SKILLS)
def test_ground_truth_and_blurred_renders_read_and_other_prompts_are_rejected(skill):
    rng = np.random.default_rng(world.SKILLS.index(skill))
    right = blurred_right = rejected = 0
    others = 0
    for prompt in _prompts(skill, PER_SKILL, rng):
        image = world.render(world.scene_for(prompt, rng))
        right += checker.satisfies(prompt, checker.read_scene(image))
        blurred_right += checker.satisfies(prompt, checker.read_scene(_blurred(image, rng)))
        # a picture of another prompt of the skill that asks for something else (not the same requirement reworded)
        other = next(p for p in _prompts(skill, 50, rng) if _requirement(p) != _requirement(prompt))
        others += 1
        rejected += not checker.satisfies(prompt, checker.read_scene(world.render(world.scene_for(other, rng))))
    print(f"{skill}: ground truth {right / PER_SKILL:.2f}, blurred {blurred_right / PER_SKILL:.2f}, "
          f"other prompts rejected {rejected / others:.2f}")
    assert right / PER_SKILL >= 0.99
    assert blurred_right / PER_SKILL >= 0.90
    assert rejected / others >= 0.95


def test_readings_name_shape_colour_place_and_area():
    scene = world.Scene((world.SceneObject("triangle", "yellow", 0, 20.0, 16.0, 16.0),
                         world.SceneObject("circle", "blue", 3, 18.0, 48.0, 47.0)))
    readings = checker.read_scene(Image.fromarray(world.render(scene)))  # PIL in, as a sampler writes
    assert [(r.shape, r.colour, r.quadrant) for r in readings] == [("triangle", "yellow", 0), ("circle", "blue", 3)]
    triangle, circle = readings
    assert abs(circle.cx - 48.0) < 0.5 and abs(circle.cy - 47.0) < 0.5
    assert abs(circle.area - np.pi * 9 ** 2) < 25 and abs(triangle.area - 200) < 25
    assert triangle.cy > 16.0  # a triangle's centroid sits below its box centre (apex up)
    prompt = world.prompt_for("position", ("triangle", "above", "circle"))
    assert checker.satisfies(prompt, readings)
    assert not checker.satisfies(world.prompt_for("position", ("triangle", "below", "circle")), readings)


def test_specks_and_an_empty_picture_read_as_nothing():
    image = np.zeros((64, 64, 3), np.uint8)
    assert checker.read_scene(image) == []
    image[10:14, 10:14] = (230, 40, 40)  # 16 px: a speck, not an object
    assert checker.read_scene(image) == []
    assert not checker.satisfies(world.prompt_for("single_object", ("square",)), [])
    with pytest.raises(ValueError, match="RGB"):
        checker.read_scene(np.zeros((64, 64), np.uint8))


def test_counting_rejects_an_extra_object_of_another_shape():
    rng = np.random.default_rng(0)
    prompt = world.prompt_for("counting", ("two", "circle"))
    scene = world.scene_for(prompt, rng)
    free = next(q for q in range(4) if q not in {o.quadrant for o in scene.objects})
    extra = world.Scene((*scene.objects, world.random_object(rng, "square", "red", free)))
    assert checker.satisfies(prompt, checker.read_scene(world.render(scene)))
    assert not checker.satisfies(prompt, checker.read_scene(world.render(extra)))


def test_features_are_named_continuous_and_full_rank():
    rng = np.random.default_rng(0)
    features = np.stack([checker.scene_features(world.render(world.random_scene(rng))) for _ in range(200)])
    assert features.shape == (200, checker.FEATURE_DIM) and features.dtype == np.float64
    assert len(checker.FEATURE_NAMES) == checker.FEATURE_DIM == len(set(checker.FEATURE_NAMES))
    assert np.isfinite(features).all()
    assert np.linalg.matrix_rank(np.cov(features.T)) == checker.FEATURE_DIM
    image = world.render(world.random_scene(np.random.default_rng(1)))
    assert np.array_equal(checker.scene_features(image), checker.scene_features(Image.fromarray(image)))
