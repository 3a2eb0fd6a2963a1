"""bench_speculative: smoke mode on a tiny untrained run writes its figures; a missing run names the demo script."""

import json

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


def test_missing_run_dir_says_to_run_the_demo_first(tmp_path, results_dir):
    with pytest.raises(FileNotFoundError, match="scripts/demo.sh"):
        bench_speculative.run(run_dir=tmp_path / "no-demo-here")
    assert bench_speculative.main(["--run-dir", str(tmp_path / "no-demo-here")]) == 2
    assert not (results_dir / "speculative.json").exists()
