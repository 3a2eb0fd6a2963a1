"""bench_speculative: smoke mode on a tiny untrained run writes its figures; a missing run names the demo script."""

import json

import numpy as np
import pytest
import torch

from bench import bench_speculative
from bench.harness import RESULTS_DIR_ENV


@pytest.fixture
def results_dir(tmp_path, monkeypatch):
    """Results go to a temp dir; torch's thread count is restored afterwards."""
    monkeypatch.setenv(RESULTS_DIR_ENV, str(tmp_path / "results"))
    threads = torch.get_num_threads()
    yield tmp_path / "results"
    torch.set_num_threads(threads)


def test_smoke_mode_counts_forwards_and_compares_every_window_with_plain(results_dir):
    bench_speculative.run(smoke=True)
    body = json.loads((results_dir / "speculative.json").read_text())
    assert body["config"]["windows"] == [0, 4, 8] and body["config"]["batch"] == 1
    assert set(body["figures"]) == {"demo_settings", "temperature1_cfg1"}
    grid = body["config"]["image_grid"]
    for setting, windows in body["figures"].items():
        assert set(windows) == set(bench_speculative.VARIANTS), setting
        plain = windows["window0"]
        assert plain["images"] == 10 * bench_speculative.SMOKE_SAMPLES_PER_DIGIT
        assert plain["image_codes_per_image"] == grid[0] * grid[1]
        # the plain path makes one forward per code (the prefill, with the forced <boi>, gives the first); the
        # forced <eoi> needs none
        assert plain["forwards_per_image"] == plain["image_codes_per_image"]
        for key in ("window4", "window8", "window4_independent", "window8_independent"):
            sjd = windows[key]
            assert sjd["image_codes_per_image"] == plain["image_codes_per_image"]
            assert sjd["forwards_per_image"] <= plain["forwards_per_image"], (setting, key)
            assert sjd["forwards_speedup_vs_plain"] == pytest.approx(
                plain["forwards_per_image"] / sjd["forwards_per_image"])
            assert sjd["codes_per_forward"] == pytest.approx(sjd["image_codes_per_image"] / sjd["forwards_per_image"])
            timed = sjd["time_speedup_vs_plain"]
            assert timed["pairs"] == plain["images"] and timed["speedup_median"] > 0
            assert sjd["accuracy_diff_points"] == pytest.approx(100 * (sjd["accuracy"] - plain["accuracy"]))
            assert 0 <= sjd["accuracy"] <= 1 and sjd["complete_fraction"] == 1.0
            assert sjd["accuracy_diff_se_points"] >= 0
        for row in windows.values():  # the distribution-level scores exist for every variant, plain included
            assert row["frechet_distance_to_real"] >= 0 and row["frechet_distance_to_plain_half"] >= 0
            assert row["diversity"] > 0
    assert body["config"]["real_digits"] > 0


def _record(features, correct):
    n = len(correct)
    return {"forwards": [16] * n, "image_codes": [16] * n, "wall_s": [0.01] * n, "cpu_s": [0.01] * n,
            "correct": np.array(correct), "complete": np.ones(n, dtype=bool), "features": features,
            "targets": np.arange(n) % 10}


def test_an_unchanged_distribution_matches_the_floor_and_a_shifted_one_does_not():
    rng = np.random.default_rng(0)
    real, plain = rng.normal(size=(400, 4)), rng.normal(size=(400, 4))
    correct = rng.random(400) < 0.8
    same = bench_speculative.summarise({"window0": _record(plain, correct), "window4": _record(plain, correct)}, real)
    floor = same["window0"]["frechet_distance_to_plain_half"]
    assert same["window4"]["frechet_distance_to_plain_half"] == pytest.approx(floor)
    assert same["window4"]["accuracy_diff_points"] == 0 and same["window4"]["accuracy_diff_se_points"] == 0
    shifted = bench_speculative.summarise(
        {"window0": _record(plain, correct), "window4": _record(rng.normal(size=(400, 4)) + 0.5, ~correct)}, real)
    assert shifted["window4"]["frechet_distance_to_plain_half"] > floor + 0.5
    assert shifted["window4"]["frechet_distance_to_real"] > shifted["window0"]["frechet_distance_to_real"] + 0.5
    # every image flips: the paired standard error of the difference is that of a +-1 variable
    assert shifted["window4"]["accuracy_diff_se_points"] > 0


def test_missing_run_dir_says_to_run_the_demo_first(tmp_path, results_dir):
    with pytest.raises(FileNotFoundError, match="scripts/demo.sh"):
        bench_speculative.run(run_dir=tmp_path / "no-demo-here")
    assert bench_speculative.main(["--run-dir", str(tmp_path / "no-demo-here")]) == 2
    assert not (results_dir / "speculative.json").exists()


def test_a_difference_can_be_rechecked_on_fresh_seeds_for_one_setting_and_variant(results_dir):
    assert bench_speculative.main(["--smoke", "--settings", "temperature1_cfg1", "--variants", "window4",
                                   "--seed", "5000"]) == 0
    body = json.loads((results_dir / "speculative.json").read_text())
    assert set(body["figures"]) == {"temperature1_cfg1"}
    assert set(body["figures"]["temperature1_cfg1"]) == {"window0", "window4"}
    assert body["config"]["windows"] == [0, 4] and body["config"]["seeds"].startswith("first seed + image index (5000")


def test_only_a_whole_image_counts_as_made():
    from types import SimpleNamespace

    from tokenizer.vocab import UnifiedVocab

    vocab = SimpleNamespace(pad_id=0, bos_id=1, boi_id=8, eoi_id=9, eos_id=2, bov_id=None, eov_id=None,  # no video
                            image_offset=16, image_codes=4,
                            decode_text=lambda ids: " ".join(map(str, ids)), _as_list=UnifiedVocab._as_list)
    vocab.spans = lambda ids: UnifiedVocab.spans(vocab, ids)  # the vocabulary's one document parser
    rows = [[100, 101, 8, 16, 17, 18, 19, 9, 2],  # text, then a whole image
            [8, 19, 18, 17, 16, 9],  # an image straight away
            [100, 8, 16, 17, 9],  # the image stops early
            [100, 101, 2]]  # no image at all
    codes, complete = bench_speculative.image_codes(vocab, rows, (2, 2))
    assert complete.tolist() == [True, True, False, False]
    assert codes[0].flatten().tolist() == [0, 1, 2, 3] and codes[1].flatten().tolist() == [3, 2, 1, 0]
    assert codes[2].abs().sum() == 0 and codes[3].abs().sum() == 0
