"""The runner: discovery, bounded child processes, and the BENCHMARKS.md table built from result files."""

import json
import re
import shutil
import subprocess
import sys

import pytest

from bench import bench_scale, run, summary
from bench.harness import RESULTS_DIR, PairedResult, write_result


def test_discover_lists_every_bench_module_by_name():
    names = run.discover()
    files = sorted(p.stem for p in run.BENCH_DIR.glob("bench_*.py"))
    assert names == [f.removeprefix("bench_") for f in files]
    assert "limits" in names


def _fake_results(directory):
    write_result(
        "alpha",
        {"figures": {"encode": PairedResult(2.0, 1.5, 2.5, 7, 0.1, 0.2).as_dict(),
                     "medium": {"mfu": {"value": 0.41, "unit": "of peak"}, "tokens_per_s": 12345.0}},
         "config": {"batch": 8}, "elapsed_s": 3.2},
        directory,
    )
    write_result("limits", {"figures": {"matmul_peak": {"value": 2.5e11, "unit": "FLOP/s", "dtype": "float32"}},
                            "config": {}}, directory)


def test_markdown_shows_ratio_spread_values_limits_and_when(tmp_path):
    _fake_results(tmp_path)
    text = run.render_markdown(tmp_path, failures={"beta": "timed out after 5 s"})
    rows = {line.split("|")[2].strip(): line for line in text.splitlines() if line.startswith("| alpha")}
    assert "**2.00×**" in rows["encode"] and "1.50–2.50×" in rows["encode"] and "| 7 |" in rows["encode"]
    assert "41.0% of peak" in rows["medium.mfu"]
    assert "| 12.3 ktok/s |" in rows["medium.tokens_per_s"]  # unit read off the name
    assert all("UTC, M1, load " in row for row in rows.values())
    assert "| limits | matmul_peak | 250 GFLOP/s (dtype float32) |" in text
    assert "- `beta`: timed out after 5 s" in text
    assert "- M1: " in text and "torch" in text
    assert "Not measured yet: no GPU result" in text  # no gpu.json here
    assert '**alpha**, ran 3.2 s: `{"batch": 8}`' in text


def test_flat_speedup_keys_render_as_one_ratio_with_spread(tmp_path):
    figures = {"small": {"speedup_vs_ref": 1.6, "speedup_q25": 1.2, "speedup_q75": 2.2, "pairs": 4,
                         "ours_median_s": 0.5, "reference_median_s": 0.8, "ours_tokens_per_s": 82.0,
                         "ours_mfu_vs_peak": 0.25, "steps": 12345}}
    write_result("flat", {"figures": figures, "config": {}}, tmp_path)
    rows = [line for line in run.render_markdown(tmp_path).splitlines() if line.startswith("| flat")]
    assert len(rows) == 4
    assert "| small.speedup_vs_ref | **1.60×** | 1.20–2.20× | 4 | 0.5 / 0.8 |" in rows[0]
    assert "| small.ours_tokens_per_s | 82 tok/s |" in rows[1]
    assert "| small.ours_mfu_vs_peak | 25.0% |" in rows[2]
    assert "| small.steps | 12,345 |" in rows[3]


def test_a_json_without_figures_is_no_benchmark_result(tmp_path):
    """bench.compare_revisions writes revision.json into bench/results: it adds no row and no machine."""
    _fake_results(tmp_path)
    (tmp_path / "revision.json").write_text(json.dumps({"before": "/tmp/before", "rounds": 5}))
    text = run.render_markdown(tmp_path)
    assert "| revision |" not in text and "**revision**" not in text
    assert "- M2:" not in text  # alpha and limits share one machine


def test_markdown_gives_gpu_results_their_own_section(tmp_path):
    write_result("gpu", {"figures": {"train_mfu": {"value": 0.45, "unit": "of peak"}}, "config": {}}, tmp_path)
    text = run.render_markdown(tmp_path)
    gpu_section = text.split("## GPU")[1].split("##")[0]
    assert "| gpu | train_mfu | 45.0% of peak |" in gpu_section
    assert "Not measured" not in gpu_section


def test_runner_runs_a_bench_in_a_child_and_writes_results_and_markdown(tmp_path):
    markdown = tmp_path / "BENCH.md"
    code = run.main(["limits", "--smoke", "--results-dir", str(tmp_path / "r"), "--markdown", str(markdown)])
    assert code == 0
    body = json.loads((tmp_path / "r" / "limits.json").read_text())
    assert body["smoke"] is True and body["elapsed_s"] >= 0 and body["figures"]["matmul_peak"]["value"] > 0
    assert "| limits | matmul_peak |" in markdown.read_text()


def test_smoke_run_without_a_results_dir_keeps_away_from_bench_results(monkeypatch, tmp_path):
    seen = {}

    def fake_child(name, smoke, out_dir, max_seconds, compare_seconds):
        seen[name] = (out_dir, compare_seconds)
        return "ok"

    monkeypatch.setattr(run, "_run_in_child", fake_child)
    assert run.main(["limits", "--smoke"]) == 0
    out_dir, compare_seconds = seen["limits"]
    assert out_dir != RESULTS_DIR and "bench-smoke-" in out_dir.name
    assert compare_seconds == 1.0  # smoke comparisons are capped short
    shutil.rmtree(out_dir)


def test_runner_kills_a_bench_that_overruns_its_time(tmp_path):
    # no interpreter starts and imports torch in 10 ms, so this always overruns
    status = run._run_in_child("limits", True, tmp_path, max_seconds=0.01, compare_seconds=None)
    assert status.startswith("timed out after 0.01 s")
    assert not (tmp_path / "limits.json").exists()


def test_runner_rejects_unknown_names_and_bad_limits(tmp_path, capsys):
    assert run.main(["no_such_bench", "--results-dir", str(tmp_path)]) == 2
    assert "unknown benchmark" in capsys.readouterr().err
    assert run.main(["limits", "--max-seconds", "0", "--results-dir", str(tmp_path)]) == 2


def test_run_one_refuses_a_payload_without_figures(tmp_path, monkeypatch):
    import bench.bench_limits as bench_limits

    monkeypatch.setattr(bench_limits, "run", lambda smoke=False: {"config": {}})
    with pytest.raises(TypeError, match="bench_limits.py.*'figures'"):
        run.run_one("limits", smoke=True, out_dir=tmp_path)


def test_render_only_rewrites_markdown_from_existing_results(tmp_path):
    _fake_results(tmp_path)
    markdown = tmp_path / "B.md"
    assert run.main(["--render-only", "--results-dir", str(tmp_path), "--markdown", str(markdown)]) == 0
    assert "**2.00×**" in markdown.read_text()


def test_python_dash_m_bench_lists_the_benchmarks():
    done = subprocess.run([sys.executable, "-m", "bench", "--list"], cwd=run.REPO_ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == run.discover()


# ---------------------------------------------------------------- the summary that opens BENCHMARKS.md


def _summary_rows(text):
    block = text.split(summary.START_MARKER)[1].split(summary.END_MARKER)[0]
    lines = [line for line in block.splitlines() if line.startswith("| `")]
    return {line.split("|")[1].strip().strip("`"): [cell.strip() for cell in line.split("|")[2:-1]] for line in lines}


def _headings(text):
    anchors = summary.Anchors()
    return {anchors.add(line.lstrip("#").strip()) for line in text.splitlines() if re.match(r"#{1,6} ", line)}


def test_summary_has_one_row_per_result_file_before_the_detail(tmp_path):
    _fake_results(tmp_path)
    (tmp_path / "revision.json").write_text(json.dumps({"after_over_before_speed": {"train_step_speed": 1.25}}))
    (tmp_path / "notes.md").write_text("not a result")
    text = run.render_markdown(tmp_path)
    assert text.startswith("# Benchmarks\n")
    assert text.index(summary.START_MARKER) < text.index("## Summary") < text.index(summary.END_MARKER)
    assert text.index(summary.END_MARKER) < text.index("## Ratios and figures")
    rows = _summary_rows(text)
    assert sorted(rows) == sorted(path.stem for path in tmp_path.glob("*.json")) == ["alpha", "limits", "revision"]
    # a file without figures still gets its row, but no machine, no figure row and no configuration
    assert rows["revision"][0].startswith("**1.25×** training-step speed") and rows["revision"][2:4] == ["—", "—"]
    assert "[bench/results/revision.json](bench/results/revision.json)" in rows["revision"][4]
    assert "| revision |" not in text and "**revision**" not in text


def test_summary_ratio_is_the_one_in_the_result_file(tmp_path):
    # a name with a headline entry: its headline figure is decoder's medium.eager
    paired = PairedResult(1.8234, 1.61, 1.97, 9, 0.5, 0.91).as_dict()
    write_result("decoder", {"figures": {"medium": {"eager": paired, "compiled": {**paired, "speedup_median": 1.3}}},
                             "config": {}}, tmp_path)
    _fake_results(tmp_path)
    rows = _summary_rows(run.render_markdown(tmp_path))
    stored = json.loads((tmp_path / "decoder.json").read_text())["figures"]["medium"]["eager"]["speedup_median"]
    headline, goal, machine, measured, links = rows["decoder"]
    assert headline.startswith(f"**{stored:.2f}×** vs transformers Chameleon") and "1.82×" in headline
    assert "(IQR 1.61×–1.97×)" in headline and "1.30× compiled" in headline
    assert goal == "—"  # neither the result nor bench/bench_decoder.py states one
    assert machine.endswith("(M1)") and "thread" in machine and measured[:2] == "20"
    # a name without one: its first side-by-side ratio, labelled by its figure
    assert rows["alpha"][0].startswith("**2.00×** `encode` (IQR 1.50×–2.50×)")
    assert rows["limits"][0].startswith("— (no ratio")


def test_summary_goal_comes_from_the_result_else_the_benchmark(tmp_path):
    ratio = PairedResult(150.0, 140.0, 160.0, 6, 0.1, 15.0).as_dict()
    write_result("data", {"figures": {"stream_vs_demo_train_step": {**ratio, "goal": 100.0}}, "config": {}}, tmp_path)
    write_result("mot", {"figures": {"train_half_image": {"mot_time_over_dense": {"value": 1.07}}},
                         "config": {"goal": "train step mot_time_over_dense <= 1.15"}}, tmp_path)
    write_result("scale", {"figures": {"after": {"first_batch_100x_over_1x": 0.6}}, "config": {}}, tmp_path)
    # the summary alone: mot's and scale's own sections want whole results
    rows = _summary_rows("\n".join(summary.render_summary(tmp_path, {})))
    assert rows["data"][1] == "≥ 100×"  # the figure's own goal
    assert rows["mot"][1] == "train step mot_time_over_dense ≤ 1.15"  # the config's
    assert rows["mot"][0].startswith("**1.07×** MoT / dense")
    assert rows["scale"][1] == f"≤ {bench_scale.GOAL_RATIO:g}× at 100×"  # bench/bench_scale.py's constant
    assert rows["scale"][0].startswith("**0.60×**") and "peak RSS" not in rows["scale"][0]  # absent, not made up


def test_summary_links_lead_to_headings_of_the_document(tmp_path):
    _fake_results(tmp_path)
    write_result("gpu", {"figures": {"train_step_1b": {"mfu_vs_measured_matmul": {"value": 0.45, "unit": "of peak"}}},
                         "config": {}}, tmp_path)
    text = run.render_markdown(tmp_path)
    rows = _summary_rows(text)
    assert rows["gpu"][0].startswith("**45.0%** MFU")
    headings = _headings(text)
    for name, cells in rows.items():
        targets = re.findall(r"\]\(#([^)]+)\)", cells[4])
        assert targets and all(target in headings for target in targets), (name, cells[4], headings)


def test_rendering_twice_gives_the_same_file(tmp_path):
    _fake_results(tmp_path)
    (tmp_path / "revision.json").write_text(json.dumps({"after_over_before_speed": {"train_step_speed": 1.01}}))
    markdown = tmp_path / "B.md"
    assert run.main(["--render-only", "--results-dir", str(tmp_path), "--markdown", str(markdown)]) == 0
    first = markdown.read_text()
    assert run.main(["--render-only", "--results-dir", str(tmp_path), "--markdown", str(markdown)]) == 0
    assert markdown.read_text() == first == run.render_markdown(tmp_path)
    assert first.count(summary.START_MARKER) == 1 and first.count("## Summary") == 1


def test_every_stored_result_has_its_headline_figures():
    """The headline paths in bench/summary.py name figures the stored results really hold."""
    results = summary.load_all(RESULTS_DIR)
    assert results, "no stored results in bench/results"
    for name, body in results.items():
        text = summary.headline_text(name, body)
        assert "not in this result" not in text, (name, text)
        spec = summary.HEADLINES.get(name)
        if spec is not None and spec.parts:
            shown = [summary._part_text(body.get("figures", body), part, i == 0) for i, part in enumerate(spec.parts)]
            assert all(shown), (name, shown)


def test_the_anchor_of_a_heading_is_githubs():
    assert summary.slug("GPU (`bench/gpu.sh`)") == "gpu-benchgpush"
    assert summary.slug("Data at scale: one rank's start-up and memory (issue #33, `bench/bench_scale.py`)") == (
        "data-at-scale-one-ranks-start-up-and-memory-issue-33-benchbench_scalepy")
    anchors = summary.Anchors()
    assert [anchors.add("Machines"), anchors.add("Machines")] == ["machines", "machines-1"]
