"""The scenes suite on a random decoder and an untrained 64-px tokenizer: every skill is scored with its ceilings, the
figures repeat for the same seed, and a family that writes no images is scored on what it can do."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from data_shards import scenes as world
from evaluation.base import EvalContext, EvalSettings
from evaluation.scenes import RANKED_CEILING, SceneSuite, round_trip
from fusion_model.config import FusionConfig
from fusion_model.families import family_class
from fusion_model.families.loading import LoadedFamily
from tokenizer.image import ImageTokenizer
from tokenizer.image.config import ImageTokenizerConfig
from tokenizer.vocab import train_unified_vocab

SETTINGS = EvalSettings(seed=3, samples_per_prompt=2, prompts_per_skill=2, understanding_items=6, text_documents=4,
                        batch_size=8, cfg_scale=1.0)


@pytest.fixture(scope="module")
def world_parts():
    """A vocabulary of the world's words, an untrained 8x8-code tokenizer for 64-px scenes, a random decoder."""
    torch.manual_seed(0)
    texts = [p.caption for s in world.SKILLS for p in world.prompts(s)] + world.held_out_text_documents(20)
    vocab = train_unified_vocab(texts * 3, vocab_size=600, image_codes=64)
    tokenizer = ImageTokenizer(ImageTokenizerConfig(image_size=64, base_channels=8, channel_multiplier=(1, 1, 1, 1),
                                                    num_res_blocks=1, latent_channels=8, norm_groups=4,
                                                    codebook_size=64)).eval()
    config = FusionConfig.from_preset("tiny", vocab_size=vocab.vocab_size, image_offset=vocab.image_offset,
                                      image_codes=vocab.image_codes, max_seq_len=256)
    family = family_class("chameleon")(config)
    parts = family.build()
    for part in parts.values():
        part.eval()
    return vocab, tokenizer, LoadedFamily(family, parts)


def _context(world_parts, settings=SETTINGS) -> EvalContext:
    vocab, tokenizer, loaded = world_parts
    return EvalContext(loaded, vocab, tokenizer, settings, progress=lambda line: None)


def test_every_skill_is_scored_with_its_ceilings_and_repeats_for_the_same_seed(world_parts):
    first = SceneSuite().run(_context(world_parts))
    figures = first.figures
    assert set(figures["generation"]) == set(world.SKILLS)
    for skill, row in figures["generation"].items():
        assert row["count"] == SETTINGS.prompts_per_skill * SETTINGS.samples_per_prompt
        assert row["ceiling_ground_truth"] == 1.0, skill  # the checker reads the world's own renders
        assert 0.0 <= row["accuracy"] <= 1.0 and 0.0 <= row["made_image"] <= 1.0
        # an untrained tokenizer's reconstructions are mush: no skill can be ranked on them
        assert row["ranked"] == (row["ceiling_reconstruction"] >= RANKED_CEILING)
        assert 0.0 <= row["floor_caption_blind"] < 1.0
    assert figures["understanding"]["items"] == SETTINGS.understanding_items
    assert set(figures["understanding"]) == {"count", "colour", "position", "overall", "items"}
    assert all(0.0 <= figures["understanding"][k] <= 1.0 for k in ("count", "colour", "position", "overall"))
    assert figures["text_loss"] > 0
    distribution = figures["distribution"]
    assert distribution["frechet_real"] >= 0 and distribution["frechet_reconstruction"] > distribution["frechet_real"]
    assert first.samples and {s.group for s in first.samples} >= {f"generation: {s}" for s in world.SKILLS}
    again = SceneSuite().run(_context(world_parts))
    assert again.figures == figures


def test_another_seed_draws_other_samples(world_parts):
    other = dataclasses.replace(SETTINGS, seed=4)
    a = SceneSuite().run(_context(world_parts)).figures
    b = SceneSuite().run(_context(world_parts, other)).figures
    assert a["distribution"] != b["distribution"]


def test_round_trip_keeps_shape_and_dtype(world_parts):
    _, tokenizer, _ = world_parts
    images = [world.render(world.scene_for(world.prompts("colours")[0], np.random.default_rng(0)))]
    [back] = round_trip(tokenizer, images)
    assert back.shape == (64, 64, 3) and back.dtype == np.uint8


def test_a_tokenizer_of_another_size_is_refused_in_one_sentence(world_parts):
    vocab, _, loaded = world_parts
    small = ImageTokenizer(ImageTokenizerConfig(image_size=16, base_channels=8, channel_multiplier=(1, 1, 1),
                                                num_res_blocks=1, latent_channels=8, norm_groups=4, codebook_size=64))
    with pytest.raises(ValueError, match="64-px scenes but --media-tokenizer makes 16-px images"):
        SceneSuite().check(EvalContext(loaded, vocab, small, SETTINGS))
    with pytest.raises(ValueError, match="--media-tokenizer"):
        SceneSuite().check(EvalContext(loaded, vocab, None, SETTINGS))
