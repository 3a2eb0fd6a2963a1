"""The scene world: seeded 64x64 pictures of up to four coloured shapes (one per quadrant, on black), their captions
for GenEval's six skills, the held-out caption split, questions about scenes, and the training documents built from
them (`training_samples`; the ingest source `data_shards.sources.demo_scenes`).

The world is drawn by rules so that `evaluation.scene_checker` can read any picture back by rules and score a model
exactly and offline (GenEval, Ghosh et al. 2023, scores with a detector; here the detector cannot be wrong on the
ground truth). numpy and PIL only.

Conventions (documented once, used everywhere):
- the background is black (0, 0, 0): an object is any pixel whose brightest channel is clearly above zero;
- quadrants are numbered 0 "top left", 1 "top right", 2 "bottom left", 3 "bottom right" (row = q // 2, column = q % 2);
- an object's side is 16-24 px and its box stays at least `QUADRANT_MARGIN` px inside its 32x32 quadrant, so two
  objects are always >= 4 px apart (a blurred reconstruction does not merge them), and each covers >= 2x2 of the
  image tokenizer's 8-px codes;
- a Prompt's `combination` is the tuple of its caption's slot words (`combinations(skill)` enumerates them).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
from PIL import Image

from data_shards.sample import Sample

SIZE = 64
BACKGROUND = (0, 0, 0)  # black: foreground = brightness, and a colour's chromaticity survives blur into black
# well separated in chromaticity (each divided by its brightest channel), so a dim or blurred pixel keeps its name
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (230, 40, 40), "green": (40, 210, 60), "blue": (50, 90, 240), "yellow": (235, 215, 40)}
SHAPES = ("square", "circle", "triangle")  # differ by silhouette: template IoU tells them apart even when blurred
QUADRANTS = ("top left", "top right", "bottom left", "bottom right")
NUMBERS = ("one", "two", "three", "four")
RELATIONS = ("left of", "right of", "above", "below")
SKILLS = ("single_object", "two_objects", "counting", "colours", "position", "colour_attribution")
MIN_SIDE, MAX_SIDE = 16.0, 24.0
QUADRANT_MARGIN = 2.0  # px between an object's box and its quadrant's edge
SUPERSAMPLE = 4  # shapes are drawn at 4x and averaged down: smooth edges, sub-pixel positions
HELD_OUT_FRACTION = 0.22  # of each skill's caption combinations (single_object: none, it has only 3)
MIN_COMBINATIONS_TO_HOLD_OUT = 6  # a skill with fewer combinations holds none out
# seed streams: training documents and evaluation scenes never share a generator
TRAIN_STREAM, EVAL_STREAM, HELD_OUT_TEXT_STREAM = 11, 23, 37
QUESTION_KINDS = ("count", "colour", "position")
COUNT_QUESTION = "how many shapes?"


@dataclass(frozen=True)
class SceneObject:
    """One drawn object: its shape and colour names, its quadrant (0-3), side and box centre in pixels."""

    shape: str
    colour: str
    quadrant: int
    side: float
    cx: float
    cy: float


@dataclass(frozen=True)
class Scene:
    """The objects of one picture (at most one per quadrant), in quadrant order."""

    objects: tuple[SceneObject, ...]


@dataclass(frozen=True)
class Prompt:
    """A caption of one skill and what the checker verifies: `shapes` (the objects named, in caption order), their
    `colours` (None where the caption names none), `count` (counting) and `relation` (position: shapes[0] is
    `relation` shapes[1]). `combination` is the caption's slot words (the key of `combinations(skill)`)."""

    skill: str
    caption: str
    combination: tuple[str, ...]
    shapes: tuple[str, ...]
    colours: tuple[str | None, ...]
    count: int | None = None
    relation: str | None = None


@dataclass(frozen=True)
class Question:
    """An understanding item: a scene, the question's kind (count, colour, position), its text and answer."""

    scene: Scene
    kind: str
    question: str
    answer: str


# ---------------------------------------------------------------- drawing


def shape_mask(shape: str, x: float, y: float, width: float, height: float, size: int = SIZE) -> np.ndarray:
    """Coverage in [0, 1] of each pixel of a (size, size) image by `shape` drawn in the box at (x, y) (top-left) of
    `width` x `height` px, supersampled (`SUPERSAMPLE`); the checker draws its templates with it too."""
    k = SUPERSAMPLE
    centres = (np.arange(size * k) + 0.5) / k
    u = (centres[None, :] - x) / width  # 0..1 across the box
    v = (centres[:, None] - y) / height
    inside_box = (u >= 0) & (u < 1) & (v >= 0) & (v < 1)
    if shape == "square":
        fine = inside_box
    elif shape == "circle":
        fine = (u - 0.5) ** 2 + (v - 0.5) ** 2 < 0.25
    elif shape == "triangle":  # apex at the top middle, base along the bottom
        fine = inside_box & (np.abs(u - 0.5) <= v / 2)
    else:
        raise ValueError(f"unknown shape {shape!r}; shapes are {SHAPES}")
    return fine.reshape(size, k, size, k).mean(axis=(1, 3))


def render(scene: Scene) -> np.ndarray:
    """The scene as uint8 (64, 64, 3): each object in its colour on black, edges antialiased."""
    canvas = np.zeros((SIZE, SIZE, 3), dtype=np.float64)
    for obj in scene.objects:
        cover = shape_mask(obj.shape, obj.cx - obj.side / 2, obj.cy - obj.side / 2, obj.side, obj.side)
        canvas += cover[..., None] * np.asarray(COLOURS[obj.colour], dtype=np.float64)  # objects never overlap
    return np.rint(np.clip(canvas, 0, 255)).astype(np.uint8)


def quadrant_of(x: float, y: float, size: int = SIZE) -> int:
    """The quadrant (0-3) a point lies in."""
    return int(y >= size / 2) * 2 + int(x >= size / 2)


def random_object(rng: np.random.Generator, shape: str, colour: str, quadrant: int) -> SceneObject:
    """`shape` in `colour` in `quadrant`, with a random side (16-24 px) and a centre jittered inside the quadrant."""
    side = float(rng.uniform(MIN_SIDE, MAX_SIDE))
    half = SIZE / 2
    x0, y0 = (quadrant % 2) * half, (quadrant // 2) * half
    low, high = side / 2 + QUADRANT_MARGIN, half - side / 2 - QUADRANT_MARGIN
    return SceneObject(shape, colour, quadrant, side, x0 + float(rng.uniform(low, high)),
                       y0 + float(rng.uniform(low, high)))


def _scene(objects: list[SceneObject]) -> Scene:
    return Scene(tuple(sorted(objects, key=lambda o: o.quadrant)))


# ---------------------------------------------------------------- captions and prompts


def combinations(skill: str) -> list[tuple[str, ...]]:
    """Every caption combination (slot words) of `skill`, in a fixed order."""
    if skill == "single_object":
        return [(s,) for s in SHAPES]
    if skill == "two_objects":
        return [(a, b) for a, b in itertools.permutations(SHAPES, 2)]
    if skill == "counting":
        return list(itertools.product(NUMBERS, SHAPES))
    if skill == "colours":
        return list(itertools.product(COLOURS, SHAPES))
    if skill == "position":
        return [(a, r, b) for a, b in itertools.permutations(SHAPES, 2) for r in RELATIONS]
    if skill == "colour_attribution":  # distinct shapes (so each object is named once); colours may repeat
        return [(c1, s1, c2, s2) for s1, s2 in itertools.permutations(SHAPES, 2) for c1 in COLOURS for c2 in COLOURS]
    raise ValueError(f"unknown skill {skill!r}; skills are {SKILLS}")


def prompt_for(skill: str, combination: tuple[str, ...]) -> Prompt:
    """The prompt (caption and requirement) of one combination of `skill`."""
    if tuple(combination) not in combinations(skill):
        raise ValueError(f"{combination!r} is not a combination of skill {skill!r}")
    c = tuple(combination)
    if skill == "single_object":
        return Prompt(skill, f"a {c[0]}", c, (c[0],), (None,))
    if skill == "two_objects":
        return Prompt(skill, f"a {c[0]} and a {c[1]}", c, c, (None, None))
    if skill == "counting":
        n = NUMBERS.index(c[0]) + 1
        return Prompt(skill, f"{c[0]} {c[1]}{'s' if n > 1 else ''}", c, (c[1],), (None,), count=n)
    if skill == "colours":
        return Prompt(skill, f"a {c[0]} {c[1]}", c, (c[1],), (c[0],))
    if skill == "position":
        return Prompt(skill, f"a {c[0]} {c[1]} a {c[2]}", c, (c[0], c[2]), (None, None), relation=c[1])
    return Prompt(skill, f"a {c[0]} {c[1]} and a {c[2]} {c[3]}", c, (c[1], c[3]), (c[0], c[2]))


def prompts(skill: str) -> list[Prompt]:
    """Every prompt of `skill` (one per combination)."""
    return [prompt_for(skill, c) for c in combinations(skill)]


_BY_CAPTION: dict[str, Prompt] = {}


def parse_caption(caption: str) -> Prompt | None:
    """The prompt whose caption is exactly `caption` (stripped, lower case), or None."""
    if not _BY_CAPTION:  # built once: 153 captions
        _BY_CAPTION.update({p.caption: p for skill in SKILLS for p in prompts(skill)})
    return _BY_CAPTION.get(caption.strip().lower())


# ---------------------------------------------------------------- the held-out split


def _coverage_units(combination: tuple[str, ...]) -> set[tuple]:
    """What training must still show for `combination` to be held out: with three or more slots every pair of
    (slot, word)s; with two slots each (slot, word) (the pair is the caption itself, the new thing held out)."""
    slots = list(enumerate(combination))
    if len(slots) >= 3:
        return {(a, b) for a, b in itertools.combinations(slots, 2)}
    return {(a,) for a in slots}


@functools.lru_cache(maxsize=64)  # every document asks for its skill's split
def _held_out(skill: str, seed: int) -> tuple[tuple[str, ...], ...]:
    """The held-out combinations of `skill`: a seeded greedy choice of about HELD_OUT_FRACTION of them, each taken
    only if the combinations left still cover its units (`_coverage_units`)."""
    every = combinations(skill)
    if len(every) < MIN_COMBINATIONS_TO_HOLD_OUT:
        return ()
    want = max(1, round(HELD_OUT_FRACTION * len(every)))
    rng = np.random.default_rng([seed, SKILLS.index(skill)])
    chosen: list[tuple[str, ...]] = []
    for index in rng.permutation(len(every)).tolist():
        candidate = every[index]
        kept = [c for c in every if c not in chosen and c != candidate]
        covered = set().union(*(_coverage_units(c) for c in kept))
        if _coverage_units(candidate) <= covered:
            chosen.append(candidate)
        if len(chosen) == want:
            break
    return tuple(sorted(chosen, key=every.index))


def held_out_captions(seed: int = 0) -> dict[str, list[str]]:
    """Per skill, the captions training never writes: about 22% of its combinations, chosen so that every pair of
    slot words of a held-out caption (for two-slot captions: every word in its slot) still appears in a training
    caption of that skill. single_object (3 captions) holds out none: its evaluation uses new scenes of trained
    captions."""
    return {skill: [prompt_for(skill, c).caption for c in _held_out(skill, seed)] for skill in SKILLS}


def training_prompts(skill: str, seed: int = 0) -> list[Prompt]:
    """The prompts of `skill` that training writes (all but the held-out ones)."""
    held = set(_held_out(skill, seed))
    return [prompt_for(skill, c) for c in combinations(skill) if c not in held]


def held_out_prompts(skill: str, seed: int = 0) -> list[Prompt]:
    """The held-out prompts of `skill` (none for single_object)."""
    return [prompt_for(skill, c) for c in _held_out(skill, seed)]


def evaluation_prompts(per_skill: int, seed: int = 0, split_seed: int = 0) -> list[Prompt]:
    """`per_skill` prompts of every skill, skill by skill: cycling through the held-out prompts in a seeded order
    (single_object: through its trained prompts); `split_seed` is the held-out split's seed."""
    rng = np.random.default_rng([seed, EVAL_STREAM])
    out: list[Prompt] = []
    for skill in SKILLS:
        pool = held_out_prompts(skill, split_seed) or training_prompts(skill, split_seed)
        order = [pool[i] for i in rng.permutation(len(pool)).tolist()]
        out += [order[i % len(order)] for i in range(per_skill)]
    return out


# ---------------------------------------------------------------- scenes of prompts


def scene_for(prompt: Prompt, rng: np.random.Generator) -> Scene:
    """A random scene that satisfies `prompt` and shows nothing else: single_object and colours exactly that one
    object; two_objects, position and colour_attribution exactly the two objects; counting exactly `count`
    objects, all of that shape. Colours the caption leaves open are random; so are quadrants, except for position:
    `left of`/`right of` put the two in one row (random), `above`/`below` in one column (random)."""
    colours = list(COLOURS)

    def colour(named: str | None) -> str:
        return named if named is not None else colours[int(rng.integers(len(colours)))]

    if prompt.skill == "position":
        line = int(rng.integers(2))  # the row (left/right) or the column (above/below)
        if prompt.relation in ("left of", "right of"):
            first, second = 2 * line, 2 * line + 1  # left column, right column of that row
        else:
            first, second = line, line + 2  # top row, bottom row of that column
        if prompt.relation in ("right of", "below"):
            first, second = second, first
        quadrants = [first, second]
        shapes = list(prompt.shapes)
        named = [None, None]
    elif prompt.skill == "counting":
        quadrants = rng.permutation(4)[: prompt.count].tolist()
        shapes = [prompt.shapes[0]] * prompt.count
        named = [None] * prompt.count
    else:
        quadrants = rng.permutation(4)[: len(prompt.shapes)].tolist()
        shapes, named = list(prompt.shapes), list(prompt.colours)
    objects = [random_object(rng, s, colour(c), q) for s, c, q in zip(shapes, named, quadrants)]
    return _scene(objects)


def random_scene(rng: np.random.Generator, min_objects: int = 1, max_objects: int = 4) -> Scene:
    """A scene of a random number of objects (shapes, colours, quadrants all random)."""
    n = int(rng.integers(min_objects, max_objects + 1))
    quadrants = rng.permutation(4)[:n].tolist()
    return _scene([random_object(rng, SHAPES[int(rng.integers(len(SHAPES)))],
                                 list(COLOURS)[int(rng.integers(len(COLOURS)))], q) for q in quadrants])


def describe(scene: Scene) -> str:
    """Every object with its place: `a red square at the top left and a blue circle at the bottom right`."""
    return " and ".join(f"a {o.colour} {o.shape} at the {QUADRANTS[o.quadrant]}" for o in scene.objects)


# ---------------------------------------------------------------- questions


def questions(scene: Scene) -> list[Question]:
    """Every question the scene answers unambiguously: how many shapes; the colour of each shape drawn once; the
    place of each colour+shape drawn once."""
    out = [Question(scene, "count", COUNT_QUESTION, NUMBERS[len(scene.objects) - 1])]
    shapes = [o.shape for o in scene.objects]
    pairs = [(o.colour, o.shape) for o in scene.objects]
    for obj in scene.objects:
        if shapes.count(obj.shape) == 1:
            out.append(Question(scene, "colour", f"what colour is the {obj.shape}?", obj.colour))
    for obj in scene.objects:
        if pairs.count((obj.colour, obj.shape)) == 1:
            out.append(Question(scene, "position", f"where is the {obj.colour} {obj.shape}?",
                                QUADRANTS[obj.quadrant]))
    return out


def _held_out_scene(rng: np.random.Generator, split_seed: int = 0) -> Scene:
    """A scene of a random held-out prompt (a skill with held-out captions, then one of them)."""
    skills = [s for s in SKILLS if held_out_prompts(s, split_seed)]
    pool = held_out_prompts(skills[int(rng.integers(len(skills)))], split_seed)
    return scene_for(pool[int(rng.integers(len(pool)))], rng)


def understanding_items(count: int, seed: int = 0) -> list[Question]:
    """`count` questions about scenes of held-out prompts, drawn from a seed stream (EVAL_STREAM) training never
    uses; the kinds cycle count, colour, position (a kind the scene cannot ask falls back to count)."""
    rng = np.random.default_rng([seed, EVAL_STREAM, 1])
    items: list[Question] = []
    for i in range(count):
        asked = questions(_held_out_scene(rng))
        kind = QUESTION_KINDS[i % len(QUESTION_KINDS)]
        of_kind = [q for q in asked if q.kind == kind] or asked[:1]
        items.append(of_kind[int(rng.integers(len(of_kind)))])
    return items


_ANSWERS = {"count": NUMBERS, "colour": tuple(COLOURS), "position": QUADRANTS}
_DIGITS = {"1": "one", "2": "two", "3": "three", "4": "four"}


def parse_answer(kind: str, text: str) -> str | None:
    """The first answer word of `kind` in a model's answer text (case and '-' between words ignored; digits 1-4
    read as number words), or None when it names none."""
    if kind not in _ANSWERS:
        raise ValueError(f"unknown question kind {kind!r}; kinds are {QUESTION_KINDS}")
    words = " ".join(text.lower().replace("-", " ").replace("?", " ").replace(".", " ").replace(",", " ").split())
    padded = f" {words} "
    found = [(padded.find(f" {a} "), a) for a in _ANSWERS[kind] if f" {a} " in padded]
    if kind == "count":
        found += [(padded.find(f" {d} "), w) for d, w in _DIGITS.items() if f" {d} " in padded]
    return min(found)[1] if found else None


# ---------------------------------------------------------------- training documents


def _image(scene: Scene) -> Image.Image:
    return Image.fromarray(render(scene), mode="RGB")


def _caption_document(rng: np.random.Generator, split_seed: int) -> tuple[str, list]:
    """[caption, image] of a training prompt (skill uniform, then prompt uniform): the tokenizer pipeline may flip
    it to image -> caption."""
    skill = SKILLS[int(rng.integers(len(SKILLS)))]
    pool = training_prompts(skill, split_seed)
    prompt = pool[int(rng.integers(len(pool)))]
    return "caption", [prompt.caption, _image(scene_for(prompt, rng))]


def _training_scene(rng: np.random.Generator, split_seed: int) -> Scene:
    """A scene of a training prompt (so questions and edits show the same distribution of scenes as captions)."""
    skill = SKILLS[int(rng.integers(len(SKILLS)))]
    pool = training_prompts(skill, split_seed)
    return scene_for(pool[int(rng.integers(len(pool)))], rng)


def _question_document(rng: np.random.Generator, split_seed: int) -> tuple[str, list]:
    """[image, question, " answer"]: three segments, never flipped (only 2-segment pairs are); the answer is its
    own segment, so its tokens start at a known place."""
    asked = questions(_training_scene(rng, split_seed))
    kind = QUESTION_KINDS[int(rng.integers(len(QUESTION_KINDS)))]
    of_kind = [q for q in asked if q.kind == kind] or asked[:1]
    q = of_kind[int(rng.integers(len(of_kind)))]
    return "question", [_image(q.scene), q.question, f" {q.answer}"]


def _edit_document(rng: np.random.Generator, split_seed: int) -> tuple[str, list]:
    """[image, "add a blue circle at the bottom right", edited image]: one object added in an empty quadrant."""
    scene = _training_scene(rng, split_seed)
    while len(scene.objects) == 4:
        scene = _training_scene(rng, split_seed)
    free = [q for q in range(4) if q not in {o.quadrant for o in scene.objects}]
    added = random_object(rng, SHAPES[int(rng.integers(len(SHAPES)))], list(COLOURS)[int(rng.integers(len(COLOURS)))],
                          free[int(rng.integers(len(free)))])
    edited = _scene([*scene.objects, added])
    instruction = f"add a {added.colour} {added.shape} at the {QUADRANTS[added.quadrant]}"
    return "edit", [_image(scene), instruction, _image(edited)]


def training_samples(count: int, seed: int = 0, interleaved_fraction: float = 0.05, question_fraction: float = 0.3,
                     split_seed: int = 0) -> Iterator[Sample]:
    """`count` training documents: caption documents [caption, image] of every skill's training captions,
    question documents [image, question, " answer"] (fraction `question_fraction`) and edit documents [image,
    instruction, edited image] (fraction `interleaved_fraction`). Document i is drawn from its own generator
    (seed, TRAIN_STREAM, i), so a prefix is the same whatever `count`; keys `scenes_s{seed}_{i:06d}_{kind}`."""
    if not 0 <= interleaved_fraction + question_fraction <= 1:
        raise ValueError("interleaved_fraction + question_fraction must lie in [0, 1]")
    for i in range(count):
        rng = np.random.default_rng([seed, TRAIN_STREAM, i])
        draw = float(rng.random())
        if draw < interleaved_fraction:
            kind, segments = _edit_document(rng, split_seed)
        elif draw < interleaved_fraction + question_fraction:
            kind, segments = _question_document(rng, split_seed)
        else:
            kind, segments = _caption_document(rng, split_seed)
        yield Sample(f"scenes_s{seed}_{i:06d}_{kind}", segments)


def held_out_text_documents(count: int, seed: int = 0) -> list[str]:
    """`count` held-out captions drawn at random (their own seed stream): text the training documents never hold,
    in the form they hold text (a caption after `<s>`), for a held-out text loss."""
    rng = np.random.default_rng([seed, HELD_OUT_TEXT_STREAM])
    skills = [s for s in SKILLS if held_out_prompts(s)]
    docs = []
    for _ in range(count):
        pool = held_out_prompts(skills[int(rng.integers(len(skills)))])
        docs.append(pool[int(rng.integers(len(pool)))].caption)
    return docs
