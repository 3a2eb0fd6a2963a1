"""The digits suite on a random decoder, an untrained 64-px tokenizer and an untrained classifier: every figure is
there, the figures repeat for the same settings, and a family that writes no images is scored on what it can do."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from evaluation import digits_data as data
from evaluation.base import EvalContext, EvalSettings
from evaluation.digits import DigitOptions, DigitSuite

SETTINGS = EvalSettings(seed=3, samples_per_prompt=2, prompts_per_skill=3, understanding_items=4, text_documents=4,
                        batch_size=8, cfg_scale=1.0)


def _run(built, family="chameleon", settings=SETTINGS, **options):
    vocab, tokenizer, families, base = built
    context = EvalContext(families[family], vocab, tokenizer, settings, progress=lambda line: None)
    suite = DigitSuite(dataclasses.replace(base, **options))
    suite.check(context)
    return suite.run(context)


def test_every_figure_is_there_and_repeats_for_the_same_settings(parts):
    first = _run(parts)
    figures = first.figures
    assert figures["writes_images"] is True
    assert figures["understanding"]["count"] == SETTINGS.understanding_items
    generation = figures["generation"]
    assert generation["count"] == 10 * SETTINGS.samples_per_prompt and 0 <= generation["accuracy"] <= 1
    assert set(generation["per_digit"]) == set(data.DIGIT_WORDS)
    distribution = figures["distribution"]
    assert distribution["sample_count"] == 10 * SETTINGS.samples_per_prompt
    assert distribution["reference_count"] == 60 - distribution["sample_count"]
    assert distribution["frechet_real"] >= 0 and distribution["frechet_reconstruction"] >= 0
    if generation["complete"] >= 2:
        assert distribution["frechet_distance"] >= 0
    assert figures["interleaved"]["count"] == SETTINGS.prompts_per_skill
    assert figures["text_loss"] > 0
    assert set(figures["summary"]) == {"understanding", "generation", "frechet_distance", "diversity",
                                       "interleaved", "text_loss"}
    assert {s.group for s in first.samples} >= {"understanding", "generation", "interleaved arithmetic"}
    assert _run(parts).figures == figures
    other = _run(parts, settings=dataclasses.replace(SETTINGS, seed=4)).figures
    assert other["distribution"]["frechet_real"] != distribution["frechet_real"]  # another floor subset


def test_a_family_that_writes_no_images_is_scored_on_what_it_can_do(parts):
    figures = _run(parts, "llava").figures
    assert figures["writes_images"] is False
    assert figures["generation"] is None and figures["interleaved"] is None
    assert figures["distribution"]["frechet_distance"] is None and figures["distribution"]["frechet_real"] >= 0
    assert figures["understanding"]["count"] == SETTINGS.understanding_items and figures["text_loss"] > 0
    assert figures["summary"]["generation"] is None


def test_parts_and_plain_sampling(parts):
    figures = _run(parts, parts="generation,distribution", plain_sampling=True).figures
    assert figures["understanding"] is None and figures["text_loss"] is None and figures["interleaved"] is None
    assert set(figures["distribution"]["plain"]) == {"accuracy", "frechet_distance", "diversity"}
    with pytest.raises(ValueError, match="distribution scores the generated images"):
        _run(parts, parts="distribution")
    with pytest.raises(ValueError, match="unknown"):
        _run(parts, parts="generation,drawing")


def test_a_missing_classifier_or_tokenizer_is_refused_in_one_sentence(parts, tmp_path):
    vocab, tokenizer, families, base = parts
    context = EvalContext(families["chameleon"], vocab, tokenizer, SETTINGS)
    with pytest.raises(FileNotFoundError, match="classifier"):
        DigitSuite(DigitOptions(demo_dir=str(tmp_path))).check(context)
    with pytest.raises(ValueError, match="--demo-dir"):
        DigitSuite(DigitOptions()).check(context)
    with pytest.raises(ValueError, match="--media-tokenizer"):
        DigitSuite(base).check(EvalContext(families["chameleon"], vocab, None, SETTINGS))


def test_held_out_text_documents_are_seeded_words_of_the_training_documents():
    labels = np.arange(10)
    docs = data.held_out_text_documents(labels, 6, seed=1)
    assert docs == data.held_out_text_documents(labels, 6, seed=1) != data.held_out_text_documents(labels, 6, seed=2)
    assert all(data.parse_digit(doc) is not None for doc in docs)


def test_the_outputs_are_the_rows_the_figures_count(parts):
    result = _run(parts)
    figures, outputs = result.figures, result.outputs
    generation = outputs["generation"]
    assert len(generation["images"]) == figures["generation"]["count"]
    assert generation["correct"].mean() == figures["generation"]["accuracy"]
    assert (generation["made"] == [image is not None for image in generation["images"]]).all()
    assert (generation["predicted"][~generation["made"]] == -1).all()  # no image: nothing read
    assert len(outputs["understanding"]["texts"]) == figures["understanding"]["count"]
    arithmetic = outputs["interleaved"]
    assert arithmetic["correct"].mean() == figures["interleaved"]["accuracy"]
    labels = data.load_digits(held_out=60).test_labels  # the options' split: held_out 60, seed 0
    assert (labels[arithmetic["a_index"]] == arithmetic["pairs"][:, 0]).all()
    assert (labels[arithmetic["b_index"]] == arithmetic["pairs"][:, 1]).all()
    assert (arithmetic["targets"] == arithmetic["pairs"].sum(axis=1)).all()


def test_the_worded_sum_is_the_text_before_the_first_image():
    from PIL import Image

    from evaluation.digits import _text_before_image

    image = Image.new("RGB", (4, 4))
    assert _text_before_image([": three plus four", " is seven", image, "more"]) == ": three plus four is seven"
    assert _text_before_image([image, "after"]) == ""
    assert _text_before_image([": two plus two is four"]) == ": two plus two is four"  # no image: all the text


def test_real_reference_subset_is_class_balanced_and_disjoint():
    from evaluation.digits import balanced_split

    labels = np.repeat(np.arange(10), 7)
    subset, rest = balanced_split(labels, 3, np.random.default_rng(0))
    assert np.bincount(labels[subset], minlength=10).tolist() == [3] * 10
    assert len(np.intersect1d(subset, rest)) == 0 and len(subset) + len(rest) == len(labels)
