"""bench/gpu_fit.py stays runnable without a GPU: its dry run takes every case through `train.py fit` on CPU."""

import json
import math

import pytest
import torch

from bench import gpu_fit
from bench.harness import RESULTS_DIR


def test_dry_run_trains_every_case_and_writes_its_row(tmp_path):
    before = {p.name: p.stat().st_mtime_ns for p in RESULTS_DIR.glob("*")}
    assert gpu_fit.main(["--dry-run", "--results-dir", str(tmp_path)]) == 0
    body = json.loads((tmp_path / "gpu_fit.json").read_text())
    rows = {row["case"]: row for row in body["cases"]}
    assert list(rows) == [case.name for case in gpu_fit.CASES]
    for name, row in rows.items():
        assert row["exit_status"] == 0, (name, row["error"])
        assert row["steps"] == gpu_fit.DRY.steps and len(row["losses"]) == gpu_fit.DRY.steps, name
        assert row["losses_finite"] and all(math.isfinite(x) for x in row["losses"]), name
        assert row["step_s"] > 0 and row["tokens_per_s"] > 0, name
        assert row["measured_bytes"] is None and row["ratio"] is None, name  # no CUDA call on the dry run
        assert row["predicted_bytes"] > 0 and row["plan_error"] is None, name
        assert body["figures"][name]["planned_memory"]["value"] == row["predicted_bytes"]
    # LoRA trains a fraction of the decoder and FSDP2 shards nothing on one rank: the plans say so
    assert rows["chameleon_lora"]["predicted_bytes"] < rows["chameleon_dense"]["predicted_bytes"]
    assert body["config"]["dry_run"] is True and body["config"]["precision"] == "32-true"
    assert {p.name: p.stat().st_mtime_ns for p in RESULTS_DIR.glob("*")} == before


def test_cases_filter_and_unknown_case(tmp_path):
    assert gpu_fit.main(["--dry-run", "--cases", "chameleon_dense", "--results-dir", str(tmp_path)]) == 0
    body = json.loads((tmp_path / "gpu_fit.json").read_text())
    assert [row["case"] for row in body["cases"]] == ["chameleon_dense"]
    with pytest.raises(SystemExit):
        gpu_fit.main(["--dry-run", "--cases", "no_such_case"])


def test_a_failing_case_is_recorded_and_the_next_still_runs(tmp_path, monkeypatch):
    broken = gpu_fit.Case("broken", "codes", ("--model.config.block=no.such:Block",), what="a block that is not there")
    monkeypatch.setattr(gpu_fit, "CASES", (broken, gpu_fit.CASES[0]))
    assert gpu_fit.main(["--dry-run", "--results-dir", str(tmp_path)]) == 1
    rows = json.loads((tmp_path / "gpu_fit.json").read_text())["cases"]
    assert [row["case"] for row in rows] == ["broken", "chameleon_dense"]
    assert rows[0]["exit_status"] != 0 and rows[0]["error"] and rows[0]["steps"] == 0
    assert rows[1]["exit_status"] == 0 and rows[1]["steps"] == gpu_fit.DRY.steps


@pytest.mark.parametrize("kind", ["codes", "conversation", "features", "latent"])
def test_shards_have_the_fields_the_families_read(tmp_path, kind):
    from data_shards.token_shards import read_manifest

    manifest = read_manifest(gpu_fit.write_shards(tmp_path / kind, kind, gpu_fit.DRY))
    assert manifest["vocab_size"] == gpu_fit.DRY.vocab_size
    assert ("feature_dim" in manifest) == (kind in ("features", "latent"))
    assert (manifest.get("feature_kind") == "latent") == (kind == "latent")
    assert bool(manifest.get("conversations")) == (kind == "conversation")


def test_gpu_scale_is_about_100m_parameters():
    assert 80e6 < gpu_fit.decoder_config(gpu_fit.GPU).num_parameters() < 130e6


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU refusal")
def test_without_gpu_the_real_run_refuses_with_a_hint(capsys):
    assert gpu_fit.main([]) == 2
    assert "--dry-run" in capsys.readouterr().err
