"""`train.py experiment video`: its measurements against direct computations, and the smoke mode end to end
(tokenizer fit -> vocab --video -> shards -> fit -> the `clips` suite on each arm; the suite's own figures are
tested in tests/evaluation/test_clips_suite.py)."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pytest

from evaluation import clip_world
from experiments import video as experiment

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # the fixture is in conftest.py


def test_psnr_per_frame_and_on_the_path():
    clips = clip_world.to_model_clips(clip_world.make_clips(clip_world.all_triples()[:2], 2, seed=0).clips)
    assert np.all(experiment.frame_psnr(clips, clips) > 90)  # exact: capped by the 1e-10 floor
    noisy = clips + 0.1
    values = experiment.frame_psnr(noisy, clips)
    assert values.shape == (2, clip_world.FRAMES)
    assert np.allclose(values, 10 * math.log10(4.0 / 0.01), atol=0.05)  # every pixel off by 0.1 (none clamped)
    # the path is only where the shape goes: an error outside it does not count there
    outside = clips.clone()
    path = (clips.amax(dim=2, keepdim=True) > 2 * clip_world.FOREGROUND - 1).any(dim=1, keepdim=True)
    outside[~path.expand_as(clips)] += 0.5
    assert np.all(experiment.path_psnr(outside, clips) > 90) and np.all(experiment.frame_psnr(outside, clips) < 30)
    repeated = clips[:, :1].expand_as(clips)
    summary = experiment.psnr_summary(experiment.frame_psnr(repeated, clips))
    assert summary["per_frame_index_db"][0] > 90 > summary["per_frame_index_db"][-1]


def test_shuffled_captions_keep_the_documents_and_move_the_captions():
    captions = [clip_world.caption(*t) for t in clip_world.all_triples()] * 3
    shuffled = experiment.shuffled_captions(captions, seed=7)
    assert sorted(shuffled) == sorted(captions)
    assert np.mean([a == b for a, b in zip(shuffled, captions)]) < 0.1
    assert shuffled == experiment.shuffled_captions(captions, seed=7)


def test_the_per_frame_vq_spends_the_video_tokenizers_codes_per_clip():
    from tokenizer.image.config import ImageTokenizerConfig
    from tokenizer.video import VideoTokenizerConfig

    frame = ImageTokenizerConfig.from_preset("demo-64", **experiment.frame_vq_overrides(512))
    video = VideoTokenizerConfig.from_preset("video-demo-32")
    t = video.clip_frames // video.temporal_downsample_factor
    side = video.image_size // video.downsample_factor
    assert frame.image_size == video.image_size and frame.codebook_size == video.codebook_size == 512
    assert video.clip_frames * frame.grid_shape[0] * frame.grid_shape[1] == t * side * side == 128


def test_options_and_smoke_settings():
    parser = experiment.build_parser()
    config = experiment.config_from_args(parser.parse_args(["--smoke", "--steps", "5", "--out", "x", "--cfg-scale", "2"]))
    assert config == replace(experiment.smoke_config(), steps=5, out_dir="x", cfg_scale=2.0)
    assert experiment.config_from_args(parser.parse_args([])) == experiment.VideoExperimentConfig()
    with pytest.raises(ValueError, match="unknown size"):
        experiment.run(replace(experiment.smoke_config(), size="huge"), log=lambda m: None)


def test_the_experiment_is_listed():
    from experiments.run import EXPERIMENTS

    assert EXPERIMENTS["video"][0] == "experiments.video"


# ---------------------------------------------------------------- the smoke mode, end to end


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """The smoke mode's record (run once for the tests below)."""
    settings = experiment.smoke_config(str(tmp_path_factory.mktemp("video")))
    return settings, experiment.run(settings, log=lambda message: None)


def test_smoke_run_measures_reconstruction_at_equal_codes(smoke):
    settings, record = smoke
    rec = record["reconstruction"]
    assert rec["codes_per_clip"] == {"video_tokenizer": 128, "frame_vq": 128}
    for name in ("video_tokenizer", "frame_vq", "repeat_first_frame"):
        assert np.isfinite(rec[name]["psnr_db"]) and len(rec[name]["per_frame_index_db"]) == clip_world.FRAMES
    assert rec["repeat_first_frame"]["per_frame_index_db"][0] > 90  # the first frame is exact
    # the checker reads every ground-truth clip
    assert all(s["all"] == 1.0 for s in record["checker_ground_truth"].values())


def test_smoke_run_trains_both_arms_the_same_way_and_scores_them(smoke):
    settings, record = smoke
    runs = record["runs"]
    assert set(runs) == {"captions", "shuffled"}
    a, b = runs["captions"], runs["shuffled"]
    assert a["steps"] == b["steps"] == settings.steps and a["extra"] == b["extra"]
    assert a["document_tokens"] == b["document_tokens"] > 0  # the same documents, captions moved
    for r in (a, b):
        for name, count in (("held_out", settings.held_out_clips), ("novel", settings.novel_clips)):
            g = r[f"generation_{name}"]
            assert g["count"] == count and 0 <= g["all"] <= g["direction"] <= 1
            assert np.isfinite(r[f"video_loss_{name}"]) and r[f"video_loss_{name}"] > 0
    assert all(np.isfinite(v) for v in record["unigram_loss"].values())
    # every figure of both arms comes from the clips suite, whose results.json is in the arm's folder
    for arm in ("captions", "shuffled"):
        saved = json.loads(open(f"{settings.out_dir}/{arm}/eval/results.json").read())
        assert saved["suite"] == "clips" and saved["figures"]["generation"]["held_out"] == runs[arm]["generation_held_out"]
        assert saved["settings"]["cfg_scale"] == settings.cfg_scale and saved["options"]["split_seed"] == settings.seed
    assert record["ceiling"]["held_out"] == runs["captions"]["suite"]["ceiling"]["held_out"]


def test_smoke_run_writes_its_outputs(smoke):
    settings, record = smoke
    saved = json.loads(open(f"{settings.out_dir}/results.json").read())
    assert saved["reconstruction"]["codes_per_clip"] == record["reconstruction"]["codes_per_clip"]
    table = open(f"{settings.out_dir}/results.md").read()
    assert "per-frame 2-D VQ" in table and "shuffled model" in table and "unigram" in table
    with open(record["figure"], "rb") as handle:
        assert handle.read(8) == b"\x89PNG\r\n\x1a\n"
