"""The demo's held-out evaluation: understanding, generation and interleaved arithmetic."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from evaluation.digits import balanced_split as _balanced_split
from evaluation.frechet import frechet_distance, per_group_diversity
from experiments.demo.datasets import (
    CALCULATE,
    EQUALS,
    PLUS,
    arithmetic_pairs,
    caption_prompt,
    parse_digit,
    pick_by_label,
)
from experiments.demo.settings import GenerateSettings
from fusion_model.sampling import SamplingConfig, generate_ids
from fusion_model.sampling.generate import split_segments


def _batched(model, vocab, prompts: list[list[int]], config: SamplingConfig, batch_size: int, bar=None) -> list[list[int]]:
    out: list[list[int]] = []
    for i in range(0, len(prompts), batch_size):
        out += generate_ids(model, vocab, prompts[i:i + batch_size], config)
        if bar is not None:
            bar.update(len(prompts[i:i + batch_size]))
    return out


def _image_codes(vocab, new_ids: list[list[int]], grid: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The first generated image of each row as codes (N, h, w), and which rows produced a complete image (one that
    `generation.split_segments` keeps: closed by `<eoi>` after exactly h*w codes; zeros where none)."""
    codes = torch.zeros(len(new_ids), *grid, dtype=torch.long)
    complete = torch.zeros(len(new_ids), dtype=torch.bool)
    for r, ids in enumerate(new_ids):
        image = next((segment for segment in split_segments(ids, vocab, grid) if not isinstance(segment, str)), None)
        if image is not None:
            codes[r], complete[r] = image, True
    return codes, complete


def _text_before_image(vocab, ids: list[int]) -> str:
    """The text a row generated before its first image (`generation.split_segments`' text up to the first `<boi>`)."""
    end = ids.index(vocab.boi_id) if vocab.boi_id in ids else len(ids)
    return "".join(split_segments(ids[:end], vocab, None)).strip()


def image_sampling(settings: GenerateSettings, grid: tuple[int, int], seed: int) -> SamplingConfig:
    """Sampling settings for one generated image (temperature, top-k, CFG from the demo config)."""
    return SamplingConfig(mode="image", image_temperature=settings.temperature, image_top_k=settings.top_k,
                          cfg_scale=settings.cfg_scale, image_grid=grid, seed=seed)


def understanding(model, vocab, codes: torch.Tensor, labels: np.ndarray, *, batch_size: int = 250,
                  max_new_tokens: int = 16, bar=None) -> dict:
    """Caption held-out images (`<s> <boi> codes <eoi>` -> text, greedy) and score the digit each caption names."""
    prompts = [vocab.encode_document([grid], bos=True, eos=False) for grid in codes]
    config = SamplingConfig(mode="text", text_temperature=0.0, max_new_tokens=max_new_tokens,
                            image_grid=tuple(codes.shape[1:]))
    new_ids = _batched(model, vocab, prompts, config, batch_size, bar)
    texts = [vocab.decode_text([t for t in ids if t != vocab.eos_id]).strip() for ids in new_ids]
    predicted = [parse_digit(t) for t in texts]
    correct = [p == int(y) for p, y in zip(predicted, labels)]
    return {"texts": texts, "predicted": predicted, "accuracy": float(np.mean(correct)), "count": len(correct)}


def generation(model, vocab, image_tokenizer, classifier, settings: GenerateSettings, *, seed: int,
               batch_size: int = 100, bar=None) -> dict:
    """Generate `images_per_caption` images for each digit's caption; the independent classifier names each."""
    per = settings.images_per_caption
    targets = np.repeat(np.arange(10), per)
    prompts = [vocab.encode_document([caption_prompt(int(d))], bos=True, eos=False) for d in targets]
    grid = tuple(image_tokenizer.grid_shape)
    new_ids = _batched(model, vocab, prompts, image_sampling(settings, grid, seed), batch_size, bar)
    codes, complete = _image_codes(vocab, new_ids, grid)
    images = image_tokenizer.decode(codes)
    predicted = classifier.predict(images).numpy()
    correct = (predicted == targets) & complete.numpy()
    return {"targets": targets, "codes": codes, "images": images, "predicted": predicted,
            "complete": complete.numpy(), "accuracy": float(correct.mean()), "count": len(targets)}


def _spread_and_distance(classifier, gen: dict, reference: np.ndarray) -> tuple[float, float]:
    """Fréchet distance to the reference features and per-caption diversity of one generation pass's complete images
    (an incomplete row decodes from placeholder codes: not a sample of the model's images). NaN below two images."""
    complete = gen["complete"]
    if complete.sum() < 2:
        return float("nan"), float("nan")
    features = classifier.penultimate_features(gen["images"][torch.as_tensor(complete)]).numpy()
    return frechet_distance(features, reference), per_group_diversity(features, gen["targets"][complete])


def distribution(model, vocab, image_tokenizer, classifier, settings: GenerateSettings, gen: dict,
                 real_images: torch.Tensor, real_labels: np.ndarray, reconstructed: torch.Tensor, *, seed: int,
                 batch_size: int = 100, bar=None) -> dict:
    """Distribution-level scores in the classifier's 128-d penultimate feature space, which accuracy cannot see.

    `gen` (the images `generation` made with the demo's sampling settings) and one more pass of the same size sampled
    plainly (temperature 1, no top-k, no guidance) are each scored by their Fréchet distance to held-out real digits
    and by their diversity: the mean pairwise feature distance between images of the same caption, averaged over
    captions. The real reference is the held-out set minus a class-balanced subset as large as one pass; that subset
    and its tokenizer reconstructions give the distance a perfect generator would reach (sampling noise alone) and
    the one a generator bounded by the tokenizer would. `diversity_real` is the same spread over all held-out digits
    of each class.
    """
    plain = replace(settings, temperature=1.0, top_k=0, cfg_scale=1.0)
    plain_gen = generation(model, vocab, image_tokenizer, classifier, plain, seed=seed + 3, batch_size=batch_size,
                           bar=bar)
    real = classifier.penultimate_features(real_images).numpy()
    subset, rest = _balanced_split(real_labels, settings.images_per_caption, np.random.default_rng(seed + 4))
    reference = real[rest]
    fd, spread = _spread_and_distance(classifier, gen, reference)
    fd_plain, spread_plain = _spread_and_distance(classifier, plain_gen, reference)
    return {
        "frechet_distance": fd, "frechet_distance_t1_cfg1": fd_plain,
        "frechet_distance_real": frechet_distance(real[subset], reference),
        "frechet_distance_reconstructed": frechet_distance(
            classifier.penultimate_features(reconstructed[torch.as_tensor(subset)]).numpy(), reference),
        "frechet_reference_count": len(rest),
        "diversity": spread, "diversity_t1_cfg1": spread_plain,
        "diversity_real": per_group_diversity(real, real_labels),
        "generation_accuracy_t1_cfg1": plain_gen["accuracy"],
    }


def interleaved(model, vocab, image_tokenizer, classifier, test_codes: torch.Tensor, test_labels: np.ndarray,
                settings: GenerateSettings, *, seed: int, batch_size: int = 100, bar=None) -> dict:
    """Prompt `calculate <a> plus <b> equals` with held-out digit images; the model writes its worded sum and then
    the answer image (one interleaved continuation), which the classifier reads."""
    rng = np.random.default_rng(seed + 1)
    pairs = arithmetic_pairs(rng, settings.arithmetic_examples)
    a_idx = pick_by_label(test_labels, pairs[:, 0], rng)
    b_idx = pick_by_label(test_labels, pairs[:, 1], rng)
    prompts = [vocab.encode_document([CALCULATE, test_codes[a], PLUS, test_codes[b], EQUALS], bos=True, eos=False)
               for a, b in zip(a_idx, b_idx)]
    grid = tuple(image_tokenizer.grid_shape)
    # greedy text (the worded sum), then the image with the generation settings; room for 24 text tokens
    config = replace(image_sampling(settings, grid, seed + 2), mode="interleaved", text_temperature=0.0,
                     max_new_tokens=24 + grid[0] * grid[1] + 2)
    new_ids = _batched(model, vocab, prompts, config, batch_size, bar)
    codes, complete = _image_codes(vocab, new_ids, grid)
    images = image_tokenizer.decode(codes)
    predicted = classifier.predict(images).numpy()
    answers = pairs.sum(axis=1)
    correct = (predicted == answers) & complete.numpy()
    texts = [_text_before_image(vocab, ids) for ids in new_ids]
    return {"pairs": pairs, "a_index": a_idx, "b_index": b_idx, "codes": codes, "images": images, "texts": texts,
            "predicted": predicted, "answers": answers, "accuracy": float(correct.mean()), "count": len(answers)}

