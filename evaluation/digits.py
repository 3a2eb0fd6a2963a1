"""The `digits` suite: the demo's held-out evaluation on MNIST digits for any family, sampled through the family's
own `generate` (`EvalContext.sample`), read by the demo's independent classifier (`evaluation.digit_classifier`).

- understanding: held-out digits captioned greedily (`<s>` + the image, then text), the digit the caption names
  (`parse_digit`) against the label;
- generation: each digit's caption (`caption_prompt`) sampled `samples_per_prompt` times in image mode; a sample
  counts when it made a whole image that the classifier reads as the caption's digit (no image: wrong);
- distribution: Fréchet distance to held-out real digits and per-caption diversity of the generated images in the
  classifier's 128-d penultimate features. The reference is the held-out set minus a class-balanced subset as large
  as one generation pass; that subset and its round trip through the checkpoint's own image tokenizer give the
  floors (the distance sampling noise alone leaves, and the one a generator bounded by the tokenizer reaches);
  `diversity_real` is the spread over every held-out digit of each class. With `plain_sampling`, one more pass at
  temperature 1 without top-k or guidance is scored the same way (`plain`);
- interleaved arithmetic: `calculate <a> plus <b> equals` with held-out digit images; the model writes the worded
  sum (greedy) and then the answer image, which the classifier reads (`prompts_per_skill` problems);
- text loss: the decoder's mean next-token loss on held-out text documents (`digits_data.held_out_text_documents`).

A family that writes no images (late fusion) is scored on understanding and text; its generation, interleaved and
generated-image distribution figures are None (the floors are still measured).

`run` returns a `DigitResult`: the figures and page samples of any suite, plus `outputs`, every caption, generated
image and arithmetic prompt it scored (what the demo's report draws its panels from)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from evaluation import digits_data as data
from evaluation.base import (
    EvalContext,
    PageSample,
    Suite,
    SuiteResult,
    first_image,
    help_metadata,
    round_trip_pixels,
    text_of,
)
from evaluation.frechet import diversity_or_none, frechet_or_none

PARTS = ("understanding", "generation", "distribution", "interleaved", "text")
CAPTION_TOKENS = 16  # greedy tokens after a held-out digit: a caption is a few words
SUM_TEXT_TOKENS = 24  # room for the worded sum before the answer image
SHOWN = 24  # page rows per group


@dataclass(frozen=True)
class DemoDigitsOptions:
    """What a suite scored on the demo's digits needs besides the checkpoint: the finished demo (its classifier) and
    its split (the digits and chat suites' options extend it)."""

    demo_dir: str = field(default="", metadata=help_metadata("a finished demo's folder (python train.py demo): the "
                                                             "classifier it trained (generate/classifier.pt) reads the "
                                                             "digits"))
    classifier: str = field(default="", metadata=help_metadata("the classifier's state_dict (default: "
                                                               "<demo-dir>/generate/classifier.pt)"))
    held_out: int = field(default=500, metadata=help_metadata("held-out digits of the demo's split (its "
                                                              "data.held_out: 500 for the full preset, 200 for smoke)"))
    split_seed: int = field(default=0, metadata=help_metadata("the seed of the demo's split (its seed)"))

    def classifier_path(self) -> Path:
        """Where the classifier's state_dict is."""
        if self.classifier:
            return Path(self.classifier)
        if not self.demo_dir:
            raise ValueError("the demo's classifier reads the digits: pass --demo-dir (a finished demo's folder) or "
                             "--classifier")
        return Path(self.demo_dir) / "generate" / "classifier.pt"

    def check_inputs(self, context: EvalContext, suite: str) -> None:
        """Refuse, in one sentence, a context without an image tokenizer or options without a classifier file."""
        if context.media_tokenizer is None:
            raise ValueError(f"the {suite} suite shows the model digits: pass the image tokenizer bundle the "
                             "checkpoint's shards were made with (--media-tokenizer)")
        path = self.classifier_path()
        if not path.is_file():
            raise FileNotFoundError(f"{path} does not exist: the {suite} suite reads digits with the classifier a "
                                    "finished demo trained (python train.py demo), or pass --classifier")


@dataclass(frozen=True)
class DigitOptions(DemoDigitsOptions):
    """The digits suite's options: the demo's classifier and split, and which figures to compute."""

    parts: str = field(default=",".join(PARTS), metadata=help_metadata(f"comma-separated figures to compute, of "
                                                                       f"{PARTS} (distribution needs generation)"))
    plain_sampling: bool = field(default=False, metadata=help_metadata("also sample every caption at temperature 1 "
                                                                       "without top-k or guidance and score its "
                                                                       "distribution"))

    def chosen_parts(self) -> tuple[str, ...]:
        """The parts asked for, checked."""
        chosen = tuple(p.strip() for p in self.parts.split(",") if p.strip())
        unknown = [p for p in chosen if p not in PARTS]
        if unknown:
            raise ValueError(f"--parts {self.parts!r}: unknown {unknown}; choose from {', '.join(PARTS)}")
        if "distribution" in chosen and "generation" not in chosen:
            raise ValueError("--parts: distribution scores the generated images; add generation")
        return chosen


def load_classifier(path: str | Path):
    """The demo's DigitClassifier from its saved state_dict, in eval mode."""
    from common.files import load_checkpoint_file
    from evaluation.digit_classifier import DigitClassifier

    classifier = DigitClassifier()
    classifier.load_state_dict(load_checkpoint_file(path))
    return classifier.eval()


def pixels(images: list[Image.Image]) -> torch.Tensor:
    """PIL RGB images -> float (N, 3, H, W) in [-1, 1] (what the classifier reads)."""
    array = np.stack([np.asarray(image.convert("RGB")) for image in images])
    return torch.from_numpy(array).permute(0, 3, 1, 2).float() / 127.5 - 1.0


def balanced_split(labels: np.ndarray, per_class: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """`per_class` random indices of each label (shaped like one generation pass), and every other index."""
    subset = np.concatenate([rng.choice(np.flatnonzero(labels == d), min(per_class, int((labels == d).sum())),
                                        replace=False) for d in np.unique(labels)])
    return np.sort(subset), np.setdiff1d(np.arange(len(labels)), subset)


def read_digits(classifier, images: list[Image.Image | None], targets: np.ndarray) -> tuple[np.ndarray, ...]:
    """Which rows made an image, the digit the classifier reads in each (-1: none) and whether it is the target."""
    made = np.array([image is not None for image in images])
    predicted = np.full(len(targets), -1)
    if made.any():
        predicted[made] = classifier.predict(pixels([im for im in images if im is not None])).numpy()
    return made, predicted, (predicted == targets) & made


@dataclass
class DigitResult(SuiteResult):
    """A `SuiteResult` with what was scored, row by row (not JSON): `outputs["understanding"]` (texts, labels: of
    held-out digits 0..count-1), `["generation"]` (targets, images (None: no image), made, predicted (-1: none),
    correct), `["interleaved"]` (pairs, a_index and b_index into the held-out digits, and the generation keys)."""

    outputs: dict[str, dict[str, Any]] = field(default_factory=dict)


def _text_before_image(segments: list[Any]) -> str:
    """The text a sample wrote before its first image (the worded sum)."""
    end = next((i for i, s in enumerate(segments) if isinstance(s, Image.Image)), len(segments))
    return text_of(segments[:end])


class DigitSuite(Suite):
    """Understanding, generation, distribution, interleaved arithmetic and text loss on the demo's held-out digits."""

    name = "digits"
    description = ("the demo's MNIST evaluation: captions of held-out digits, digits drawn from captions (classifier "
                   "accuracy, Fréchet distance, diversity), interleaved arithmetic, text loss")
    Options = DigitOptions

    def check(self, context: EvalContext) -> None:
        """Refuse a checkpoint without an image tokenizer, a missing classifier or unknown parts."""
        self.options.chosen_parts()
        self.options.check_inputs(context, self.name)

    def run(self, context: EvalContext) -> DigitResult:
        """Every part asked for; parts not asked for (or impossible for the family) are None."""
        s, parts = context.settings, self.options.chosen_parts()
        classifier = load_classifier(self.options.classifier_path())
        split = data.load_digits(held_out=self.options.held_out, seed=self.options.split_seed)
        size = int(getattr(context.media_tokenizer.config, "image_size", 64))
        real = data.to_model_images(split.test_images, size)
        writes = context.can_make_images()
        samples: list[PageSample] = []
        scored: dict[str, dict[str, Any]] = {}  # DigitResult.outputs
        figures: dict[str, Any] = {"understanding": None, "generation": None, "distribution": None,
                                   "interleaved": None, "text_loss": None, "writes_images": writes}
        if "understanding" in parts:
            figures["understanding"] = self._understanding(context, real, split.test_labels, samples, scored)
        generated = None
        if "generation" in parts and writes:
            generated = self._generation(context, classifier, s.temperature, s.top_k, s.cfg_scale, 2)
            figures["generation"] = generated["figures"]
            scored["generation"] = {k: v for k, v in generated.items() if k != "figures"}
            self._show(samples, "generation", generated, s.samples_per_prompt)
        if "distribution" in parts:
            figures["distribution"] = self._distribution(context, classifier, real, split.test_labels, generated)
        if "interleaved" in parts and writes:
            figures["interleaved"] = self._interleaved(context, classifier, real, split.test_labels, samples,
                                                       scored)
        if "text" in parts:
            documents = data.held_out_text_documents(split.test_labels, s.text_documents, s.seed)
            figures["text_loss"] = context.text_loss(documents)
        distribution = figures["distribution"] or {}
        figures["summary"] = {
            "understanding": (figures["understanding"] or {}).get("accuracy"),
            "generation": (figures["generation"] or {}).get("accuracy"),
            "frechet_distance": distribution.get("frechet_distance"), "diversity": distribution.get("diversity"),
            "interleaved": (figures["interleaved"] or {}).get("accuracy"), "text_loss": figures["text_loss"]}
        return DigitResult(figures, samples, scored)

    # ---------------------------------------------------------------- understanding
    def _understanding(self, context: EvalContext, real: torch.Tensor, labels: np.ndarray,
                       samples: list[PageSample], scored: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
        from tokenizer.image import to_pil

        count = min(context.settings.understanding_items, len(labels))
        if count == 0:
            return None
        context.progress(f"eval digits: captioning {count} held-out digits")
        images = to_pil(real[:count])
        outputs, _ = context.sample([[image] for image in images],
                                    context.sampling("text", max_new_tokens=CAPTION_TOKENS))
        texts = [text_of(out) for out in outputs]
        predicted = [data.parse_digit(text) for text in texts]
        right = np.array([p == int(y) for p, y in zip(predicted, labels[:count])])
        scored["understanding"] = {"texts": texts, "labels": labels[:count]}
        for i in range(min(SHOWN, count)):
            samples.append(PageSample("understanding", "caption this digit", images[i], text=texts[i],
                                      correct=bool(right[i]), note=f"label: {data.DIGIT_WORDS[int(labels[i])]}"))
        return {"accuracy": float(right.mean()), "count": count, "sample_captions": texts[:8]}

    # ---------------------------------------------------------------- generation
    def _generation(self, context: EvalContext, classifier, temperature: float, top_k: int, cfg_scale: float,
                    seed: int) -> dict[str, Any]:
        """Each digit's caption `samples_per_prompt` times; the images made, which rows made one, the figures."""
        per = context.settings.samples_per_prompt
        targets = np.repeat(np.arange(10), per)
        context.progress(f"eval digits: generating {len(targets)} digits (10 captions x {per})")
        config = context.sampling("image", seed=seed, image_temperature=temperature, image_top_k=top_k,
                                  cfg_scale=cfg_scale)
        outputs, _ = context.sample([[data.caption_prompt(int(d))] for d in targets], config)
        images = [first_image(out) for out in outputs]
        made, predicted, correct = read_digits(classifier, images, targets)
        per_digit = {data.DIGIT_WORDS[d]: float(correct[targets == d].mean()) for d in range(10)}
        return {"targets": targets, "images": images, "made": made, "predicted": predicted, "correct": correct,
                "figures": {"accuracy": float(correct.mean()), "count": len(targets), "made_image": float(made.mean()),
                            "complete": int(made.sum()), "per_digit": per_digit}}

    def _show(self, samples: list[PageSample], group: str, generated: dict[str, Any], per_prompt: int) -> None:
        """The first few images of each caption on the page."""
        for i, target in enumerate(generated["targets"]):
            if i % per_prompt >= max(1, SHOWN // 10):
                continue
            image, guess = generated["images"][i], int(generated["predicted"][i])
            samples.append(PageSample(group, data.caption_prompt(int(target)), image,
                                      correct=bool(generated["correct"][i]),
                                      note=f"read: {data.DIGIT_WORDS[guess]}" if image is not None else "no image"))

    # ---------------------------------------------------------------- distribution
    def _distribution(self, context: EvalContext, classifier, real: torch.Tensor, labels: np.ndarray,
                      generated: dict[str, Any] | None) -> dict[str, Any]:
        s = context.settings
        features = classifier.penultimate_features(real).numpy()
        subset, rest = balanced_split(labels, s.samples_per_prompt, np.random.default_rng(s.seed + 4))
        reference = features[rest]
        context.progress(f"eval digits: reconstructing {len(labels)} held-out digits with the image tokenizer")
        reconstructed = round_trip_pixels(context.media_tokenizer, real, context.settings.device, batch_size=250)
        result: dict[str, Any] = {
            "feature_space": "evaluation.digit_classifier.DigitClassifier.penultimate_features (128)",
            "frechet_distance": None, "diversity": None,
            "frechet_real": frechet_or_none(features[subset], reference),
            "frechet_reconstruction": frechet_or_none(
                classifier.penultimate_features(reconstructed[torch.as_tensor(subset)]).numpy(), reference),
            "diversity_real": diversity_or_none(features, labels),
            "accuracy_real": float((classifier.predict(real).numpy() == labels).mean()),
            "accuracy_reconstruction": float((classifier.predict(reconstructed).numpy() == labels).mean()),
            "reference_count": len(rest), "sample_count": len(subset)}
        if generated is not None:
            result.update(self._spread(classifier, generated, reference))
        if self.options.plain_sampling and generated is not None:
            plain = self._generation(context, classifier, 1.0, 0, 1.0, 5)
            result["plain"] = {"accuracy": plain["figures"]["accuracy"], **self._spread(classifier, plain, reference)}
        return result

    @staticmethod
    def _spread(classifier, generated: dict[str, Any], reference: np.ndarray) -> dict[str, float | None]:
        """Fréchet distance and per-caption diversity of the images a pass made (None below two)."""
        made = generated["made"]
        if made.sum() < 2:
            return {"frechet_distance": None, "diversity": None}
        features = classifier.penultimate_features(
            pixels([im for im in generated["images"] if im is not None])).numpy()
        return {"frechet_distance": frechet_or_none(features, reference),
                "diversity": diversity_or_none(features, generated["targets"][made])}

    # ---------------------------------------------------------------- interleaved arithmetic
    def _interleaved(self, context: EvalContext, classifier, real: torch.Tensor, labels: np.ndarray,
                     samples: list[PageSample], scored: dict[str, dict[str, Any]]) -> dict[str, Any]:
        from tokenizer.image import to_pil

        s = context.settings
        rng = np.random.default_rng(s.seed + 1)
        pairs = data.arithmetic_pairs(rng, s.prompts_per_skill)
        a_idx = data.pick_by_label(labels, pairs[:, 0], rng)
        b_idx = data.pick_by_label(labels, pairs[:, 1], rng)
        shown = to_pil(real[np.unique(np.concatenate([a_idx, b_idx]))])
        pictures = dict(zip(np.unique(np.concatenate([a_idx, b_idx])).tolist(), shown))
        prompts = [[data.CALCULATE, pictures[int(a)], data.PLUS, pictures[int(b)], data.EQUALS]
                   for a, b in zip(a_idx, b_idx)]
        h, w = (int(n) for n in context.media_tokenizer.grid_shape)
        context.progress(f"eval digits: {len(prompts)} interleaved sums")
        config = context.sampling("interleaved", seed=3, max_new_tokens=SUM_TEXT_TOKENS + h * w + 2)
        outputs, _ = context.sample(prompts, config)
        answers = pairs.sum(axis=1)
        images = [first_image(out) for out in outputs]
        made, predicted, correct = read_digits(classifier, images, answers)
        texts = [_text_before_image(out) for out in outputs]
        worded = np.array([data.parse_digit(t) == int(c) for t, c in zip(texts, answers)])
        scored["interleaved"] = {"pairs": pairs, "a_index": a_idx, "b_index": b_idx, "targets": answers,
                                  "images": images, "made": made, "predicted": predicted, "correct": correct,
                                  "texts": texts}
        for i in range(min(SHOWN, len(prompts))):
            a, b = int(pairs[i, 0]), int(pairs[i, 1])
            samples.append(PageSample("interleaved arithmetic", f"calculate {a} plus {b} equals", images[i],
                                      text=texts[i], correct=bool(correct[i]),
                                      note=f"read: {data.DIGIT_WORDS[int(predicted[i])]}" if made[i] else "no image"))
        return {"accuracy": float(correct.mean()), "count": len(answers), "made_image": float(made.mean()),
                "worded_sum_accuracy": float(worded.mean())}
