"""The digits suite on a random decoder, an untrained 64-px tokenizer and an untrained classifier: every figure is
there, the figures repeat for the same settings, and a family that writes no images is scored on what it can do."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from evaluation import digits_data as data
from evaluation.base import EvalContext, EvalSettings
from evaluation.digit_classifier import DigitClassifier
from evaluation.digits import DigitOptions, DigitSuite
from fusion_model.config import FusionConfig
from fusion_model.families import family_class
from fusion_model.families.loading import LoadedFamily
from tokenizer.image import ImageTokenizer
from tokenizer.image.config import ImageTokenizerConfig
from tokenizer.vocab import train_unified_vocab

SETTINGS = EvalSettings(seed=3, samples_per_prompt=2, prompts_per_skill=3, understanding_items=4, text_documents=4,
                        batch_size=8, cfg_scale=1.0)


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    """The digits' words as a vocabulary, an untrained 4x4-code tokenizer for 64-px digits, a random chameleon
    decoder, a random llava (late-fusion) model, and an untrained classifier's state_dict on disk."""
    torch.manual_seed(0)
    texts = [data.caption(d, v) for d in range(10) for v in range(4)] + [data.CALCULATE, data.PLUS, data.EQUALS]
    vocab = train_unified_vocab(texts * 5, vocab_size=400, image_codes=32)
    tokenizer = ImageTokenizer(ImageTokenizerConfig(image_size=64, base_channels=8, channel_multiplier=(1, 1, 1, 1, 1),
                                                    num_res_blocks=1, latent_channels=8, norm_groups=4,
                                                    codebook_size=32)).eval()
    config = FusionConfig.from_preset("tiny", vocab_size=vocab.vocab_size, image_offset=vocab.image_offset,
                                      image_codes=vocab.image_codes, max_seq_len=128)
    families = {}
    for name, options in (("chameleon", {}),
                          ("llava", {"stage": 2, "feature_dim": tokenizer.config.embed_dim,
                                     "image_token_id": vocab.image_placeholder_id, "boi_id": vocab.boi_id,
                                     "eoi_id": vocab.eoi_id})):
        family = family_class(name)(config, options)
        built = family.build()
        for part in built.values():
            part.eval()
        families[name] = LoadedFamily(family, built)
    folder = tmp_path_factory.mktemp("demo")
    (folder / "generate").mkdir()
    torch.save(DigitClassifier().state_dict(), folder / "generate" / "classifier.pt")
    return vocab, tokenizer, families, DigitOptions(demo_dir=str(folder), held_out=60)


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
