"""The tokenizer-quality benchmark: a baseline of equal size, a working codebook, and a smoke run that writes
its result json and markdown table."""

import json
import math

import pytest
import torch

import bench.bench_tokenizer_quality as quality
from bench import run
from bench.harness import RESULTS_DIR_ENV
from tokenizer.image.config import ImageTokenizerConfig
from tokenizer.image.image_tokenizer import ImageTokenizer


def test_plain_vqvae_has_the_parameter_count_of_the_preset_within_ten_percent():
    ours = quality.parameter_count(ImageTokenizer(ImageTokenizerConfig.from_preset("demo-64")))
    baseline = quality.PlainVQVAE(quality.matched_width(ours))
    assert abs(quality.parameter_count(baseline) - ours) <= 0.1 * ours
    reconstruction, codes, loss = baseline(torch.zeros(2, 3, 64, 64))
    assert reconstruction.shape == (2, 3, 64, 64) and codes.shape == (2, 4, 4) and float(loss.detach()) >= 0


@pytest.mark.parametrize("downsamplings, side", [(4, 4), (3, 8)])
def test_plain_vqvae_gives_the_code_grid_it_is_asked_for(downsamplings, side):
    baseline = quality.PlainVQVAE(32, downsamplings=downsamplings)
    reconstruction, codes, _ = baseline(torch.zeros(2, 3, 64, 64))
    assert reconstruction.shape == (2, 3, 64, 64) and codes.shape == (2, side, side)


def test_the_patch_mean_baseline_is_exact_on_images_made_of_flat_patches():
    patches = torch.rand(2, 3, 8, 8) * 2 - 1
    images = patches.repeat_interleave(8, dim=2).repeat_interleave(8, dim=3)  # 64 px, flat 8 px squares
    rows = quality.mean_colour_rows(images, patch=8)
    assert rows["mean_colour_patch"]["psnr_db"] > 80 and rows["mean_colour_image"]["psnr_db"] < 30


def test_codebook_starts_from_batch_vectors_and_passes_gradients_straight_through():
    torch.manual_seed(0)
    codebook = quality.EMACodebook(size=16, dim=4)
    latents = torch.randn(2, 4, 4, 4, requires_grad=True)  # 32 vectors for 16 codes
    quantized, codes, _ = codebook(latents)
    vectors = latents.detach().permute(0, 2, 3, 1).reshape(-1, 4)
    chosen = quantized.detach().permute(0, 2, 3, 1).reshape(-1, 4)
    # the 16 first codes are 16 distinct vectors of the batch: each of those is quantized to itself exactly,
    # where an N(0, 1) codebook would send them all to a few codes
    assert int(((chosen - vectors).abs().sum(1) < 1e-5).sum()) >= 16
    assert codes.unique().numel() >= 16
    quantized.sum().backward()
    assert torch.equal(latents.grad, torch.ones_like(latents))


def test_a_negative_budget_is_refused_with_the_task_named():
    with pytest.raises(ValueError, match="digits"):
        quality.run(smoke=False, seconds={"digits": -1.0})


def test_the_runner_gives_this_benchmark_its_own_time_limit(monkeypatch, tmp_path):
    seen = {}

    def fake_child(name, smoke, out_dir, max_seconds, compare_seconds):
        seen[name] = max_seconds
        return "ok"

    monkeypatch.setattr(run, "_run_in_child", fake_child)
    assert run.main(["tokenizer_quality", "limits", "--results-dir", str(tmp_path), "--markdown", str(tmp_path / "B.md")]) == 0
    assert seen == {"tokenizer_quality": run.TIME_LIMITS_S["tokenizer_quality"], "limits": run.DEFAULT_MAX_SECONDS}
    assert run.main(["tokenizer_quality", "--max-seconds", "5", "--results-dir", str(tmp_path),
                     "--markdown", str(tmp_path / "B.md")]) == 0
    assert seen["tokenizer_quality"] == 5.0


def test_smoke_run_on_digits_writes_the_result_and_the_table(tmp_path, monkeypatch):
    monkeypatch.setenv(RESULTS_DIR_ENV, str(tmp_path))
    threads = torch.get_num_threads()
    try:
        quality.run(smoke=True, seconds={"photos": 0.0})
    finally:
        torch.set_num_threads(threads)
    body = json.loads((tmp_path / "tokenizer_quality.json").read_text())
    assert body["config"]["smoke"] is True and body["config"]["torch_threads"] == 1
    digits = body["figures"]["digits"]
    assert set(digits) == {"preset", "plain_vqvae", "mean_colour_image", "mean_colour_patch"}
    for model in ("preset", "plain_vqvae"):
        row = digits[model]
        assert row["steps"] >= 1 and 1 <= row["codes_used"] <= 512 and math.isfinite(row["psnr_db"])
        assert row["train_cpu_s"] >= quality.SMOKE_SECONDS
    assert "photos" not in body["figures"]
    table = (tmp_path / "tokenizer_quality.md").read_text()
    assert "| plain VQ-VAE |" in table and "| our preset |" in table and "## digits" in table
