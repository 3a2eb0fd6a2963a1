"""The stability benchmark: its data, the learning-rate sensitivity, the report's verdict, and a smoke run that writes
the result json, the markdown and both PNGs."""

import copy
import json

import pytest
import torch

import bench.bench_stability as stability
from bench import run
from bench.harness import RESULTS_DIR_ENV


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_documents_hold_whole_images_between_boi_and_eoi():
    data = stability.build_data(train_batches=3, batch_size=2, seq_len=64, seed=0, verse_count=400,
                                held_out_batches=2)
    assert (data.vocab_size, data.image_codes) == (stability.VOCAB_SIZE, stability.IMAGE_CODES)
    assert 0.2 < data.image_target_fraction < 0.6
    whole_images = 0
    for batch in data.train + data.held_out:
        ids, docs = batch["input_ids"], batch["document_ids"]
        assert ids.shape == docs.shape == (2, 64) and int(ids.max()) < data.vocab_size
        assert (docs[:, 0] == 0).all() and (docs.diff(dim=1) >= 0).all()
        for row in ids.tolist():
            image = [data.image_offset <= i < data.image_offset + data.image_codes for i in row] + [False]
            start = None
            for position, is_image in enumerate(image):
                if is_image and start is None:
                    start = position
                elif not is_image and start is not None:
                    assert position - start <= 16
                    if start > 0 and position < len(row):  # not cut by the row's edges: a whole bracketed grid
                        assert (row[start - 1], position - start, row[position]) == (data.boi_id, 16, data.eoi_id)
                        whole_images += 1
                    start = None
    assert whole_images > 5
    assert not torch.equal(data.train[0]["input_ids"], data.held_out[0]["input_ids"])


def test_lr_sensitivity_clips_diverged_runs_to_the_initial_loss():
    runs = [{"initial_loss": 7.0, "final_loss": final} for final in (6.0, 5.0, None, 8.0)]
    assert [stability.clipped_final(r) for r in runs] == [6.0, 5.0, 7.0, 7.0]
    assert stability.lr_sensitivity(runs) == pytest.approx((6 + 5 + 7 + 7) / 4 - 5.0)


def test_unknown_variants_and_bad_budgets_are_refused():
    with pytest.raises(ValueError, match="unknown variant"):
        stability.run(smoke=True, variants=["no_such_variant"])
    with pytest.raises(SystemExit) as stop:
        stability.main(["--minutes", "0"])
    assert stop.value.code == 2


def test_the_runner_gives_this_benchmark_its_own_time_limit(monkeypatch, tmp_path):
    seen = {}
    monkeypatch.setattr(run, "_run_in_child", lambda name, smoke, out, limit, compare: seen.setdefault(name, limit) and "ok")
    assert run.main(["stability", "--results-dir", str(tmp_path), "--markdown", str(tmp_path / "B.md")]) == 0
    assert seen["stability"] == run.TIME_LIMITS_S["stability"] >= 20 * 60


def test_smoke_run_writes_the_result_the_report_and_its_plots(tmp_path, monkeypatch, one_thread):
    monkeypatch.setenv(RESULTS_DIR_ENV, str(tmp_path))
    payload = stability.run(smoke=True, variants=["neither", "chameleon"], overhead=False)
    body = json.loads((tmp_path / "stability.json").read_text())
    assert body["config"]["smoke"] is True and body["config"]["torch_threads"] == 1
    assert len(body["runs"]) == 2 * len(stability.SMOKE_RATES)
    for run_ in body["runs"]:
        assert run_["steps_done"] == stability.SMOKE_STEPS or run_["nan_at_step"] is not None
        assert run_["curves"]["attn_logit_max"] and run_["curves"]["train_loss"]
    for variant in ("neither", "chameleon"):
        assert body["figures"][variant]["lr_sensitivity"]["value"] >= 0
    report = (tmp_path / "stability.md").read_text()
    assert "SMOKE RUN" in report and "| neither QK-norm nor z-loss |" in report and "LR sensitivity" in report
    for png in ("stability_lr_sweep.png", "stability_top_lr.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"]({png})" in report

    # a full run's verdict follows the rule fixed beforehand: 6 rates or more, and 0.02 nats between the baseline
    # and Chameleon's recipe
    full = copy.deepcopy(payload)
    full["config"]["smoke"] = False
    assert "Too few rates" in stability.markdown(full)
    full["config"]["rates"] = [1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1]
    full["figures"]["neither"]["lr_sensitivity"]["value"] = 0.31
    full["figures"]["chameleon"]["lr_sensitivity"]["value"] = 0.30
    assert "does not separate the variants" in "\n".join(stability._reading(full))
    full["figures"]["neither"]["lr_sensitivity"]["value"] = 0.50
    assert "separates the baseline from Chameleon's recipe" in "\n".join(stability._reading(full))


def test_overhead_measurement_times_the_monitor_hooks(one_thread):
    torch.set_num_threads(1)
    figures = stability.measure_overhead("tiny", steps=4, every_n_steps=2, repeats=1, batch=(2, 16))
    assert figures["steps_per_s_off"] > 0 and figures["steps_per_s_on"] > 0
    assert 0 < figures["hook_time_fraction"] < 10
