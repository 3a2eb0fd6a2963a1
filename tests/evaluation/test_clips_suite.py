"""The clips suite on a random chameleon decoder and an untrained tiny video tokenizer: every figure is there, the
checker reads the ground truth, the figures repeat for the same seed, the batches sample with the video experiment's
seeds, the losses are the direct computations, and what it cannot score is refused in one sentence."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from evaluation import clip_world as world
from evaluation.base import EvalContext, EvalSettings
from evaluation.clips import ClipOptions, ClipSuite, document_ids, unigram_loss, video_token_loss
from fusion_model.config import FusionConfig
from fusion_model.families import family_class
from fusion_model.families.loading import LoadedFamily
from tokenizer.video import VideoTokenizer, VideoTokenizerConfig
from tokenizer.vocab import train_unified_vocab

CODES = 32
OPTIONS = ClipOptions(train_clips=8, held_out_clips=5, novel_clips=3)
SETTINGS = EvalSettings(seed=3, temperature=0.7, top_k=8, cfg_scale=2.0, batch_size=2)


@pytest.fixture(scope="module")
def built():
    """The clip world's captions as a vocabulary with video markers, an untrained video tokenizer for the world's
    clips (8 frames of 32 px -> 2 x 2 x 2 codes), a random chameleon decoder."""
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a shared 2-core machine: two threads wait on each other
    texts = [world.caption(*t) for t in world.all_triples()]
    vocab = train_unified_vocab(texts * 2, vocab_size=16 + CODES + 300, image_codes=CODES, video=True,
                                min_frequency=1)
    tokenizer = VideoTokenizer(VideoTokenizerConfig(
        image_size=world.SIZE, clip_frames=world.FRAMES, codebook_size=CODES, embed_dim=4, latent_channels=4,
        base_channels=8, channel_multiplier=(1, 1, 1, 1, 1), num_res_blocks=1, attn_resolutions=(), norm_groups=4))
    with torch.no_grad():  # a spread codebook: an untrained one's constant entries would give every clip one code
        tokenizer.quantize.vq.codebook = torch.randn(CODES, 4, generator=torch.Generator().manual_seed(1)) * 0.3
    config = FusionConfig.from_preset("tiny", vocab_size=vocab.vocab_size, image_offset=vocab.image_offset,
                                      image_codes=CODES, max_seq_len=64)
    family = family_class("chameleon")(config, {})
    parts = family.build()
    for part in parts.values():
        part.eval()
    yield vocab, tokenizer.eval(), LoadedFamily(family, parts)
    torch.set_num_threads(threads)


def _context(built, settings=SETTINGS, tokenizer="video") -> EvalContext:
    vocab, video_tokenizer, loaded = built
    return EvalContext(loaded, vocab, video_tokenizer if tokenizer == "video" else tokenizer, settings,
                       progress=lambda line: None)


def _run(built, settings=SETTINGS, **options):
    suite = ClipSuite(dataclasses.replace(OPTIONS, **options))
    context = _context(built, settings)
    suite.check(context)
    return suite.run(context)


def test_every_figure_is_there_and_repeats_for_the_same_seed(built):
    first = _run(built)
    figures = first.figures
    assert set(figures) == {"split", "generation", "ceiling", "checker_ground_truth", "chance", "video_loss",
                            "unigram_loss", "summary"}
    counts = {"held_out": OPTIONS.held_out_clips, "novel": OPTIONS.novel_clips}
    for name, count in counts.items():
        g = figures["generation"][name]
        assert g["count"] == count and 0 <= g["incomplete"] <= count
        for scores in (g, figures["ceiling"][name]):
            assert all(0 <= scores[k] <= 1 for k in ("colour", "shape", "direction", "all"))
            assert scores["all"] <= min(scores["colour"], scores["shape"], scores["direction"])
        # the checker reads every ground-truth clip (its documented rate: 100%)
        assert figures["checker_ground_truth"][name]["all"] == 1.0
        assert figures["video_loss"][name] > 0 and figures["unigram_loss"][name] > 0
    assert figures["chance"] == world.CHANCE
    assert figures["split"]["novel_triples"] == [" ".join(t) for t in world.held_out_triples(6, 0)]
    assert all(v is not None for v in figures["summary"].values())
    groups = {s.group for s in first.samples}
    assert groups == {"held-out clips, trained triples", "held-out triples",
                      "ceiling: ground truth through the video tokenizer"}
    again = _run(built)
    assert again.figures == figures
    assert [np.asarray(s.image).tolist() for s in again.samples if s.image is not None] == \
        [np.asarray(s.image).tolist() for s in first.samples if s.image is not None]
    other = _run(built, dataclasses.replace(SETTINGS, seed=4))
    assert any(not np.array_equal(np.asarray(a.image), np.asarray(b.image))
               for a, b in zip(first.samples, other.samples) if a.image is not None and b.image is not None)


def test_options_leave_out_the_unseen_triples_and_the_unigram(built):
    figures = _run(built, unseen=False, train_clips=0).figures
    assert figures["generation"]["novel"] is None and figures["ceiling"]["novel"] is None
    assert figures["video_loss"]["novel"] is None and figures["unigram_loss"] is None
    assert figures["generation"]["held_out"]["count"] == OPTIONS.held_out_clips
    # the held-out clips do not depend on the other sets' sizes
    assert figures["ceiling"]["held_out"] == _run(built).figures["ceiling"]["held_out"]


def test_batches_sample_with_the_video_experiments_seeds(built):
    """Captions in sorted order, batches of batch_size, each with seed settings.seed + its first row: what the video
    experiment's own sampler did before it scored through the suite."""
    from fusion_model.sampling import SamplingConfig
    from fusion_model.sampling.generate import generate

    vocab, tokenizer, loaded = built
    captions = world.make_split(0, 5, 0, seed=0).held_out.captions
    frames, made = ClipSuite._sample(_context(built), captions)
    order = sorted(range(len(captions)), key=lambda i: captions[i])
    for start in range(0, len(order), SETTINGS.batch_size):
        rows = order[start:start + SETTINGS.batch_size]
        config = SamplingConfig(mode="video", image_temperature=SETTINGS.temperature, image_top_k=SETTINGS.top_k,
                                cfg_scale=SETTINGS.cfg_scale, seed=SETTINGS.seed + start)
        for i, segments in zip(rows, generate(loaded.parts["model"], vocab, tokenizer, [[captions[i]] for i in rows],
                                              config)):
            assert made[i] and np.array_equal(frames[i], segments[0].frames)


def test_the_loss_per_video_token_is_the_models_cross_entropy_on_the_clip_codes(built):
    vocab, _, loaded = built
    model = loaded.parts["model"]
    codes = torch.randint(0, CODES, (3, 2, 2, 2), generator=torch.Generator().manual_seed(0))
    captions = [world.caption(*t) for t in world.all_triples()[:3]]
    total, count = 0.0, 0
    with torch.no_grad():
        for caption, grid in zip(captions, codes):
            ids = torch.tensor(document_ids(vocab, caption, grid))
            logits = model(ids[None])[0, :-1]
            is_code = (ids[1:] >= vocab.image_offset) & (ids[1:] < vocab.image_offset + CODES)
            total += float(torch.nn.functional.cross_entropy(logits[is_code], ids[1:][is_code], reduction="sum"))
            count += int(is_code.sum())
    assert count == 3 * 8
    # batched with padding (2 per batch) = one document at a time
    assert video_token_loss(model, vocab, captions, codes, batch=2) == pytest.approx(total / count, rel=1e-5)


def test_unigram_loss_is_the_cross_entropy_of_add_one_counts():
    train = torch.tensor([0, 0, 0, 1])
    held = torch.tensor([0, 2])
    p = np.array([4, 2, 1, 1]) / 8  # counts + 1 over 4 codes
    assert unigram_loss(train, held, 4) == pytest.approx(-(math.log(p[0]) + math.log(p[2])) / 2)


def _one_sentence(message: str) -> bool:
    return "\n" not in message and ". " not in message.rstrip(".")


def test_what_it_cannot_score_is_refused_in_one_sentence(built):
    from tokenizer.image import ImageTokenizer
    from tokenizer.image.config import ImageTokenizerConfig

    suite = ClipSuite()
    with pytest.raises(ValueError, match="--media-tokenizer") as no_tokenizer:
        suite.check(_context(built, tokenizer=None))
    image_tokenizer = ImageTokenizer(ImageTokenizerConfig(image_size=32, base_channels=8,
                                                          channel_multiplier=(1, 1, 1, 1), num_res_blocks=1,
                                                          latent_channels=8, norm_groups=4, codebook_size=CODES))
    with pytest.raises(ValueError, match="'vq' image tokenizer") as image_only:
        suite.check(_context(built, tokenizer=image_tokenizer))
    vocab, tokenizer, loaded = built
    plain = train_unified_vocab([world.caption(*t) for t in world.all_triples()] * 2, vocab_size=16 + CODES + 300,
                                image_codes=CODES, min_frequency=1)
    with pytest.raises(ValueError, match="vocab --video") as no_markers:
        suite.check(EvalContext(loaded, plain, tokenizer, SETTINGS))
    with pytest.raises(ValueError, match="--held-out-clips") as bad_options:
        ClipSuite(ClipOptions(held_out_clips=0)).check(_context(built))
    for refused in (no_tokenizer, image_only, no_markers, bad_options):
        assert _one_sentence(str(refused.value)), str(refused.value)


def test_the_suite_is_registered_with_its_options_on_the_command_line():
    from evaluation import suite_class
    from evaluation.cli import parser

    assert suite_class("clips") is ClipSuite
    args = parser(ClipSuite).parse_args(["--checkpoint", "c", "--suite", "clips", "--vocab", "v", "--split-seed", "2",
                                         "--train-clips", "0", "--unseen", "false"])
    assert (args.split_seed, args.train_clips, args.unseen, args.held_out_clips) == (2, 0, False, 84)
