"""The `scenes` suite: GenEval's skills on the synthetic scene world (`data_shards.scenes`), scored by its rule-based
checker (`evaluation.scene_checker`), with the understanding questions, a held-out text loss and a Fréchet distance
in the checker's feature space.

Generation: each held-out caption of a skill is sampled `samples_per_prompt` times in image mode; a sample counts
when the checker reads a scene that satisfies the caption (no image: wrong). The same captions' ground-truth scenes
give two ceilings: the checker on the renders, and on their round trip through the checkpoint's own image tokenizer
(what a perfect model of the tokens would reach). Only skills whose reconstruction ceiling is at least
`RANKED_CEILING` enter `generation_score`: on the others the tokenizer, not the model, decides.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np
import torch
from PIL import Image

from data_shards import scenes as world
from evaluation import scene_checker as checker
from evaluation.base import (
    EvalContext,
    PageSample,
    Suite,
    SuiteResult,
    first_image,
    round_trip_pixels,
    text_of,
)
from evaluation.frechet import diversity_or_none, frechet_or_none

RANKED_CEILING = 0.9  # a skill is ranked only where the tokenizer's reconstructions read at least this well
ANSWER_TOKENS = 8  # greedy tokens after a question: an answer is one to three words


def _as_array(image: Image.Image | np.ndarray) -> np.ndarray:
    return np.asarray(image.convert("RGB")) if isinstance(image, Image.Image) else np.asarray(image)


def round_trip(tokenizer: Any, images: list[np.ndarray], batch_size: int = 64, device: str = "cpu") -> list[np.ndarray]:
    """Each uint8 (H, W, 3) image through the image tokenizer and back (codes or latents), as uint8."""
    pixels = torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).float() / 127.5 - 1.0
    decoded = round_trip_pixels(tokenizer, pixels, device, batch_size)
    return list(((decoded + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1).numpy())


def _random_training_prompt(rng: np.random.Generator) -> Any:
    """A training caption: a skill, then one of its trained captions, uniformly (as the training documents draw)."""
    pool = world.training_prompts(world.SKILLS[int(rng.integers(len(world.SKILLS)))])
    return pool[int(rng.integers(len(pool)))]


def _reads(prompt: Any, image: np.ndarray) -> bool:
    return bool(checker.satisfies(prompt, checker.read_scene(image)))


def _describe(image: np.ndarray) -> str:
    """What the checker read, for the page: `red square (top left), ...`."""
    readings = checker.read_scene(image)
    return ", ".join(f"{r.colour} {r.shape}" for r in readings) or "nothing"


def _features(images: list[np.ndarray]) -> np.ndarray:
    return np.stack([checker.scene_features(image) for image in images])


class SceneSuite(Suite):
    """GenEval-style compositional generation, understanding questions and text loss on the scene world."""

    name = "scenes"
    description = "compositional generation (GenEval's six skills), questions about scenes, text loss"

    def check(self, context: EvalContext) -> None:
        """Refuse a checkpoint without an image tokenizer, or one whose images are not the world's size."""
        tokenizer = context.media_tokenizer
        if tokenizer is None:
            raise ValueError("the scenes suite shows and asks for images: pass the image tokenizer bundle the "
                             "checkpoint's shards were made with (--media-tokenizer)")
        size = int(getattr(tokenizer.config, "image_size", world.SIZE))
        if size != world.SIZE:
            raise ValueError(f"the scenes suite draws {world.SIZE}-px scenes but --media-tokenizer makes "
                             f"{size}-px images: pass a tokenizer trained on the scene world (preset scenes-64 or "
                             "kl-scenes-64)")

    def run(self, context: EvalContext) -> SuiteResult:
        """Generation per skill with its ceilings, the distribution figures, understanding and text loss."""
        figures: dict[str, Any] = {}
        samples: list[PageSample] = []
        figures.update(self._generation(context, samples))
        figures["understanding"] = self._understanding(context, samples)
        documents = world.held_out_text_documents(context.settings.text_documents, context.settings.seed)
        figures["text_loss"] = context.text_loss(documents)
        figures["summary"] = {"generation_score": figures.get("generation_score"),
                              "understanding": figures["understanding"].get("overall"),
                              "text_loss": figures["text_loss"],
                              "frechet_distance": (figures.get("distribution") or {}).get("frechet_distance")}
        return SuiteResult(figures, samples)

    # ---------------------------------------------------------------- generation and its ceilings
    def _generation(self, context: EvalContext, samples: list[PageSample]) -> dict[str, Any]:
        s = context.settings
        prompts = world.evaluation_prompts(s.prompts_per_skill, s.seed)
        repeated = [p for p in prompts for _ in range(s.samples_per_prompt)]
        groups = np.repeat(np.arange(len(prompts)), s.samples_per_prompt)
        rng = np.random.default_rng([s.seed, 1])
        truth = [world.render(world.scene_for(p, rng)) for p in repeated]
        # a second draw of the same captions: the reference every Fréchet distance is measured against
        reference = [world.render(world.scene_for(p, rng)) for p in repeated]
        context.progress(f"eval scenes: reading {len(truth)} ground-truth scenes and their reconstructions")
        reconstructed = round_trip(context.media_tokenizer, truth, device=context.settings.device)
        # the floor: a scene of a random training caption, the caption asked for ignored (what a model that draws
        # plausible scenes but does not read the prompt would score)
        blind = [world.render(world.scene_for(_random_training_prompt(rng), rng)) for _ in repeated]
        blind_ok = np.array([_reads(p, im) for p, im in zip(repeated, blind)])
        truth_ok = np.array([_reads(p, im) for p, im in zip(repeated, truth)])
        recon_ok = np.array([_reads(p, im) for p, im in zip(repeated, reconstructed)])
        made = np.zeros(len(repeated), dtype=bool)
        correct = np.zeros(len(repeated), dtype=bool)
        generated: list[np.ndarray | None] = [None] * len(repeated)
        writes = context.can_make_images()
        if writes:
            context.progress(f"eval scenes: generating {len(repeated)} images ({len(prompts)} captions x "
                             f"{s.samples_per_prompt})")
            outputs, _ = context.sample([[p.caption] for p in repeated], context.sampling("image", seed=2))
            for i, (prompt, out) in enumerate(zip(repeated, outputs)):
                image = first_image(out)
                if image is not None:
                    generated[i] = _as_array(image)
                    made[i] = True
                    correct[i] = _reads(prompt, generated[i])
        skills: dict[str, Any] = {}
        for skill in world.SKILLS:
            rows = np.array([p.skill == skill for p in repeated])
            if not rows.any():
                continue
            ceiling = float(recon_ok[rows].mean())
            skills[skill] = {"accuracy": float(correct[rows].mean()) if writes else None,
                             "made_image": float(made[rows].mean()) if writes else None,
                             "count": int(rows.sum()), "captions": len({p.caption for p in repeated if p.skill == skill}),
                             "ceiling_ground_truth": float(truth_ok[rows].mean()),
                             "ceiling_reconstruction": ceiling, "ranked": ceiling >= RANKED_CEILING,
                             "floor_caption_blind": float(blind_ok[rows].mean())}
        ranked = [v["accuracy"] for v in skills.values() if v["ranked"] and v["accuracy"] is not None]
        result: dict[str, Any] = {"generation": skills,
                                  "generation_score": float(np.mean(ranked)) if ranked else None,
                                  "ranked_skills": [k for k, v in skills.items() if v["ranked"]]}
        reference_features = _features(reference)
        truth_features = _features(truth)
        recon_features = _features(reconstructed)
        distribution = {
            "feature_space": f"evaluation.scene_checker.scene_features ({reference_features.shape[1]} features)",
            "frechet_real": frechet_or_none(truth_features, reference_features),
            "frechet_reconstruction": frechet_or_none(recon_features, reference_features),
            "diversity_real": diversity_or_none(truth_features, groups),
            "frechet_distance": None, "diversity": None}
        if writes and made.sum() >= 2:
            made_features = _features([g for g in generated if g is not None])
            distribution["frechet_distance"] = frechet_or_none(made_features, reference_features)
            distribution["diversity"] = diversity_or_none(made_features, groups[made])
        result["distribution"] = distribution
        shown = defaultdict(int)
        for i, prompt in enumerate(repeated):
            if shown[prompt.skill] >= 24:
                continue
            shown[prompt.skill] += 1
            image = generated[i]
            samples.append(PageSample(
                f"generation: {prompt.skill}", prompt.caption,
                Image.fromarray(image) if image is not None else None,
                correct=bool(correct[i]) if writes else None,
                note=("read: " + _describe(image)) if image is not None else "no image"))
        return result

    # ---------------------------------------------------------------- understanding
    def _understanding(self, context: EvalContext, samples: list[PageSample]) -> dict[str, Any]:
        s = context.settings
        items = world.understanding_items(s.understanding_items, s.seed)
        if not items:
            return {}
        context.progress(f"eval scenes: answering {len(items)} questions about held-out scenes")
        prompts = [[Image.fromarray(world.render(item.scene)), item.question] for item in items]
        outputs, _ = context.sample(prompts, context.sampling("text", max_new_tokens=ANSWER_TOKENS))
        answers = [text_of(out) for out in outputs]
        right = np.array([world.parse_answer(item.kind, text) == item.answer for item, text in zip(items, answers)])
        kinds = sorted({item.kind for item in items})
        result: dict[str, Any] = {kind: float(right[[item.kind == kind for item in items]].mean()) for kind in kinds}
        result["overall"] = float(right.mean())
        result["items"] = len(items)  # not "count": that is a question kind
        for i, item in enumerate(items[:24]):
            samples.append(PageSample(f"understanding: {item.kind}", item.question, prompts[i][0], text=answers[i],
                                      correct=bool(right[i]), note=f"expected: {item.answer}"))
        return result
