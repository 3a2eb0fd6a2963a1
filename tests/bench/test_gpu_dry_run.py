"""bench/gpu.py stays runnable without a GPU: its dry run trains and generates at toy size on CPU."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import gpu
from bench.harness import RESULTS_DIR
from fusion_model.config import FusionConfig

REPO = Path(__file__).resolve().parents[2]


def _numbers(value):
    if isinstance(value, dict):
        for inner in value.values():
            yield from _numbers(inner)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        yield value


def test_dry_run_writes_train_and_image_figures(tmp_path):
    before = {p.name: p.stat().st_mtime_ns for p in RESULTS_DIR.glob("*")}
    assert gpu.main(["--dry-run", "--results-dir", str(tmp_path)]) == 0
    body = json.loads((tmp_path / "gpu.json").read_text())
    figures = body["figures"]
    train = figures["train_step_1b"]
    assert train["tokens_per_s"]["value"] > 0 and 0 < train["mfu_vs_measured_matmul"]["value"]
    assert train["step_s"]["q25"] <= train["step_s"]["value"] <= train["step_s"]["q75"]
    assert math.isfinite(body["config"]["train_step_1b"]["loss"])
    reference = figures["train_step_1b_transformers"]  # transformers' Chameleon, same shape, side by side
    assert reference["tokens_per_s"]["value"] > 0
    ratio = train["tokens_per_s"]["value"] / reference["tokens_per_s"]["value"]
    assert reference["speedup_vs_transformers"]["value"] == pytest.approx(ratio)
    image = figures["image_512px_7b"]
    assert set(image) == {"batch_1", "cfg_3_streams"}
    for stream in image.values():
        assert stream["seconds_per_image"]["value"] > 0 and stream["bandwidth_bound_fraction"]["value"] > 0
    assert body["config"]["image_512px_7b"]["image_tokens"] == 16 and body["config"]["dry_run"] is True
    sampler = figures["sampler_512px_7b"]  # the real sampler, eager, compiled and compiled + SJD, three streams
    assert set(sampler) == {"three_stream_batch1_eager", "three_stream_batch1_compiled",
                            "three_stream_batch1_compiled_speculative"}
    assert sampler["three_stream_batch1_compiled"]["forwards"]["value"] == 16  # 4x4 codes, <boi>/<eoi> forced
    for row in sampler.values():
        assert row["seconds_per_image"]["value"] > 0 and row["bandwidth_bound_fraction"]["value"] > 0
    assert all(math.isfinite(x) for x in _numbers(figures))
    assert {p.name: p.stat().st_mtime_ns for p in RESULTS_DIR.glob("*")} == before


def test_real_configs_are_the_promised_sizes():
    train = gpu.train_config(dry_run=False)
    assert train.attention_backend == "flex" and train.max_seq_len == 4096 and train.vocab_size == 65536
    assert 0.9e9 < train.num_parameters() < 1.3e9  # "a ~1B config"
    image = gpu.image_config(dry_run=False)
    assert image.num_parameters() == FusionConfig.from_preset("chameleon-7b").num_parameters() == 7_013_666_816
    assert image.image_codes == 8192


def test_packed_batch_has_the_asked_documents_and_shape():
    generator = torch.Generator().manual_seed(0)
    ids, docs = gpu.packed_batch(3, 50, 100, 4, torch.device("cpu"), generator)
    assert ids.shape == docs.shape == (3, 50) and int(ids.max()) < 100
    for row in docs:
        assert row.unique().tolist() == [0, 1, 2, 3]
        assert bool((row[1:] >= row[:-1]).all())  # documents are contiguous runs


def test_three_stream_cfg_generates_only_image_codes():
    config = gpu.image_config(dry_run=True)
    torch.manual_seed(0)
    model = gpu.FusionModel(config).eval()
    prompt = torch.tensor([[1, 200, 201, 202, 2]])
    codes = gpu.generate_image(model, prompt, 6, 3, torch.Generator().manual_seed(0))
    assert codes.shape == (6,) and int(codes.min()) >= 0 and int(codes.max()) < config.image_codes


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU refusal")
def test_without_gpu_the_real_run_refuses_with_a_hint(capsys):
    assert gpu.main([]) == 2
    assert "--dry-run" in capsys.readouterr().err


def test_shell_entry_point_passes_arguments_through(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable)
    done = subprocess.run(
        ["bash", str(REPO / "bench" / "gpu.sh"), "--dry-run", "--skip-train", "--skip-image", "--skip-sampler",
         "--results-dir", str(tmp_path)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    figures = json.loads((tmp_path / "gpu.json").read_text())["figures"]
    assert set(figures) == {"matmul_peak", "copy_bandwidth"}  # every part skipped, as asked
