"""bench_scale (issue #33's probe): the synthetic sizes share their shards, a fresh process measures one rank of a job,
revisions are extracted from git, and the ratios, the 9 TB extrapolation and the BENCHMARKS.md section add up."""

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from bench import bench_scale, run
from bench.harness import write_result

SETTINGS = {**bench_scale.SMOKE, "multipliers": (1, 3), "big_shards": None}


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    """The smoke base at 1x and 3x (built once for the module)."""
    return bench_scale.build_datasets(tmp_path_factory.mktemp("scale"), 2, 1_500, (1, 3))


def test_sizes_are_written_by_the_project_writer_and_share_their_shards(datasets):
    from data_shards.token_shards import TokenShard, read_manifest, verify_token_dir

    small, large = read_manifest(datasets[1]), read_manifest(datasets[3])
    assert [len(small["shards"]), len(large["shards"])] == [2, 6]
    assert small["shards"] == large["shards"][:2]  # shard i: the same files (same checksums) at every size
    assert small["dtype"] == "uint16" and small["vocab_size"] == 65_536
    for directory in datasets.values():
        assert verify_token_dir(directory)[1] == []
    for entry in large["shards"]:
        shard = TokenShard(datasets[3], entry["name"], 65_536)
        assert entry["tokens"] >= 1_500 and len(shard.ids) == entry["tokens"]
        assert shard.lengths.min() >= 64 and shard.lengths.max() <= 1_023


def test_a_built_dataset_is_reused_not_rewritten(datasets):
    ids = datasets[3] / "scale-000005.ids.npy"
    before = ids.stat().st_mtime_ns
    again = bench_scale.build_datasets(datasets[3].parent, 2, 1_500, (1, 3))
    assert again == datasets and ids.stat().st_mtime_ns == before


def test_a_fresh_process_measures_one_rank_of_the_job(datasets):
    from data_shards.stream import PackedTokenStream

    settings = {**SETTINGS, "rank": 1, "world_size": 2, "rate_batches": 8, "rate_seconds": 600.0}
    figures = bench_scale.measure(bench_scale.REPO, datasets[3], settings, timeout=300)
    expected = PackedTokenStream(datasets[3], settings["seq_len"], settings["batch_size"], seed=0, rank=1, world_size=2)
    assert figures["batches_per_epoch"] == len(expected)
    assert figures["first_batch_shape"] == [settings["batch_size"], settings["seq_len"]]
    assert len(expected) < 8 and figures["rate_batches"] == 8  # epochs run through when one is shorter
    assert figures["first_batch_s"] > 0 and figures["peak_rss_increase_bytes"] >= 0
    assert 0 <= figures["padding_fraction"] < 1
    assert figures["stream_tokens_per_s"] == pytest.approx(
        8 * settings["batch_size"] * settings["seq_len"] / figures["rate_s"])
    assert figures["manifest_s"] > 0 and figures["manifest_peak_rss_increase_bytes"] >= 0
    assert figures["first_batch_beyond_manifest_s"] == pytest.approx(figures["first_batch_s"] - figures["manifest_s"])


def test_a_revision_is_extracted_from_git(tmp_path):
    tree = bench_scale.materialize("HEAD", tmp_path)
    committed = subprocess.run(["git", "-C", str(bench_scale.REPO), "show", "HEAD:data_shards/stream.py"],
                               capture_output=True, text=True, check=True).stdout
    assert (tree / "data_shards" / "stream.py").read_text() == committed
    assert (tree / "train.py").is_file() and not (tree / ".git").exists()
    data_commit, _ = bench_scale.last_data_change("HEAD")
    assert subprocess.run(["git", "-C", str(bench_scale.REPO), "merge-base", "--is-ancestor", data_commit, "HEAD"]).returncode == 0
    commit, subject = bench_scale.resolve_revision("HEAD")
    assert tree.name == commit[:12] and len(commit) == 40 and subject


def test_extrapolation_is_linear_in_tokens_through_the_two_largest_sizes():
    per_size = {1: {"t": 1.0}, 10: {"t": 2.0}, 100: {"t": 12.0}}
    tokens = {1: 10, 10: 100, 100: 1_100}
    assert bench_scale.extrapolate(per_size, tokens, "t", target=2_100) == pytest.approx(22.0)


def _fake_measurements(monkeypatch, calls):
    """Before grows with the shard count, after stays flat; after offers `shards plan`."""

    def fake_measure(tree, token_dir, settings, timeout=900.0):
        from data_shards.token_shards import read_manifest

        calls.append(("measure", Path(tree).name, Path(token_dir).name))
        shards = len(read_manifest(token_dir)["shards"])
        grows = Path(tree).name.startswith("before")
        figures = {"first_batch_s": 0.1 * shards if grows else 0.2, "first_batch_cpu_s": 0.1,
                   "constructed_s": 0.05, "peak_rss_increase_bytes": 1e6 * (shards if grows else 3),
                   "peak_rss_increase_after_rate_bytes": 4e6, "stream_tokens_per_s": 1e6 if grows else 1.02e6,
                   "stream_tokens_per_cpu_s": 2e6, "real_tokens_per_cpu_s": 1.8e6 if grows else 1.71e6,
                   "real_tokens_per_s": 9e5, "padding_fraction": 0.1, "batches_per_epoch": 5,
                   "manifest_s": 0.01 * shards, "manifest_cpu_s": 0.01 * shards,
                   "manifest_peak_rss_increase_bytes": 1e5 * shards}
        figures["first_batch_beyond_manifest_s"] = figures["first_batch_s"] - figures["manifest_s"]
        figures["first_batch_cpu_beyond_manifest_s"] = figures["first_batch_cpu_s"] - figures["manifest_cpu_s"]
        figures["peak_rss_beyond_manifest_bytes"] = (figures["peak_rss_increase_bytes"]
                                                     - figures["manifest_peak_rss_increase_bytes"])
        return figures

    def fake_materialize(revision, into):
        path = Path(into) / revision
        path.mkdir()
        return path

    monkeypatch.setattr(bench_scale, "measure", fake_measure)
    monkeypatch.setattr(bench_scale, "materialize", fake_materialize)
    monkeypatch.setattr(bench_scale, "resolve_revision", lambda rev: (f"{rev:0<40}", f"subject of {rev}"))
    monkeypatch.setattr(bench_scale, "last_data_change", lambda rev: (f"{rev:1<40}", f"data change of {rev}"))
    monkeypatch.setattr(bench_scale, "has_plan_command", lambda tree, timeout=300.0: Path(tree).name == "after")

    def fake_plan(tree, token_dir, seq_len, timeout=1800.0):
        calls.append(("plan", Path(tree).name, Path(token_dir).name))
        return 1.5

    monkeypatch.setattr(bench_scale, "write_plan", fake_plan)


def test_probe_alternates_trees_writes_plans_first_and_reports_ratios(tmp_path, monkeypatch, datasets):
    calls: list[tuple[str, str, str]] = []
    _fake_measurements(monkeypatch, calls)
    settings = {**SETTINGS, "base_shards": 2, "tokens_per_shard": 1_500, "repeats": 2}
    payload = bench_scale.probe({"before": "before", "after": "after"}, settings, datasets[3].parent, log=False)
    x1, x3 = datasets[1].name, datasets[3].name
    assert calls == [("plan", "after", x1), ("plan", "after", x3),
                     ("measure", "before", x1), ("measure", "after", x1),
                     ("measure", "before", x3), ("measure", "after", x3),
                     ("measure", "after", x1), ("measure", "before", x1),  # the second round runs after first
                     ("measure", "after", x3), ("measure", "before", x3)]
    figures = payload["figures"]
    assert figures["before"]["first_batch_3x_over_1x"] == pytest.approx(3.0)
    assert figures["before"]["peak_rss_3x_over_1x"] == pytest.approx(3.0)
    assert figures["after"]["first_batch_3x_over_1x"] == pytest.approx(1.0)
    assert figures["after_over_before_stream_tokens_per_s"] == pytest.approx(1.02)
    assert payload["plan_s"] == {"before": {}, "after": {"1": 1.5, "3": 1.5}}
    tokens = {int(m): s["tokens"] for m, s in payload["config"]["sizes"].items()}
    slope = (0.6 - 0.2) / (tokens[3] - tokens[1])  # 0.1 s per shard: 0.2 s at 1x, 0.6 s at 3x
    assert payload["summary"]["before"]["at_9tb_linear"]["first_batch_s"] == pytest.approx(
        0.6 + slope * (bench_scale.CHAMELEON_TOKENS - tokens[3]))
    assert payload["config"]["trees"]["after"]["plan_command"] is True


def test_the_section_shows_both_trees_the_goal_and_9_tb(tmp_path, monkeypatch, datasets):
    _fake_measurements(monkeypatch, [])
    monkeypatch.setattr(bench_scale, "epoch_order_seconds", lambda shards: 1.0)  # 1 ms per 1,000 shards
    settings = {**SETTINGS, "base_shards": 2, "tokens_per_shard": 1_500, "repeats": 1, "big_shards": (1, 4_000)}
    payload = bench_scale.probe({"before": "before", "after": "after"}, settings, datasets[3].parent, log=False)
    write_result("scale", {**payload, "smoke": False}, tmp_path)
    text = run.render_markdown(tmp_path)
    section = text.split("## Data at scale")[1].split("\n## ")[0]
    assert "| before | 3× | 6 |" in section and "| after | 1× | 2 |" in section
    assert "| after | 3× tokens in big shards | 1 |" in section
    assert "| stream tok/CPU s, big shards, after / before | 1.000 |" in section
    assert "| after | 3× tokens in big shards, the only rank | 1 |" in section
    assert "| stream tok/CPU s, big shards, the only rank, after / before | 1.000 |" in section
    assert "| first batch beyond the manifest (wall) 3x / 1x | 3.00× | 0.78× | ≤ 1.5 |" in section
    assert "| first batch (wall) 3x / 1x | 3.00× | 1.00× | ≤ 1.5 |" in section
    assert "| first batch (CPU) 3x / 1x | 1.00× | 1.00× | ≤ 1.5 |" in section
    assert "| peak RSS 3x / 1x | 3.00× | 1.00× | ≤ 1.5 |" in section
    assert "| stream tok/s (wall), after / before at the largest size | 1.020 |" in section
    assert "| stream tok/CPU s, after / before at the largest size | 1.000 |" in section
    assert "| non-padding tok/CPU s, after / before at the largest size | 0.950 |" in section
    assert "| before |" in section.split("On paper at 9 TB")[1] and "linear in tokens" in section
    assert "| after | 0.20 s | 0.10 s | 3.0 MB | as measured at 3× |" in section
    # the manifest's cost per 1,000 shards: 0.01 s and 0.1 MB a shard -> 10 s and 100 MB per 1,000, plus the
    # stream's epoch order (1 ms) and its 24 bytes of arrays a shard
    assert "the metadata read costs 10001.00 ms, 10001.00 ms CPU and 100,024 KB per 1,000 shards" in section
    assert "| after, metadata linear in shards | 7.3 min |" in section  # 0.2 s + 10 ms x (44,000 - 6) shards
    assert "`shards plan` run first" in section and "no `shards plan` in this tree" in section
    assert "- **after**: after0000000, data_shards/ as of after1111111 data change of after;" in section
    # its headline figures are in the main table too
    assert "| scale | before.first_batch_3x_over_1x | 3 |" in text


def test_scale_json_round_trips_through_json(tmp_path, monkeypatch, datasets):
    _fake_measurements(monkeypatch, [])
    settings = {**SETTINGS, "base_shards": 2, "tokens_per_shard": 1_500, "repeats": 1}
    payload = bench_scale.probe({"before": "before"}, settings, datasets[3].parent, log=False)
    body = json.loads(write_result("scale", payload, tmp_path).read_text())
    assert body["measurements"]["before"]["3"]["first_batch_s"] == pytest.approx(0.6)
    assert "pending" in "\n".join(bench_scale.section({**body, "smoke": False}))
    assert np.isfinite(body["summary"]["before"]["at_9tb_linear"]["peak_rss_increase_bytes"])
