"""Every `bench/bench_*.py` runs in smoke mode (seconds) and yields finite figures, so no benchmark rots."""

import json
import math

import pytest
import torch

import bench.harness as harness
from bench import run
from bench.harness import COMPARE_SECONDS_ENV, RESULTS_DIR_ENV


def _leaves(value, label=""):
    """Every number inside a figure, with its dotted label."""
    if isinstance(value, dict):
        for key, inner in value.items():
            yield from _leaves(inner, f"{label}.{key}" if label else str(key))
    elif isinstance(value, (list, tuple)):
        for i, inner in enumerate(value):
            yield from _leaves(inner, f"{label}[{i}]")
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        yield label, value


@pytest.fixture
def isolated(tmp_path, monkeypatch):
    """Results go to a temp dir, comparisons are capped short, and global torch settings are restored."""
    monkeypatch.setenv(RESULTS_DIR_ENV, str(tmp_path / "results"))
    monkeypatch.setenv(COMPARE_SECONDS_ENV, "1")
    # were the override ignored, results would land here instead of bench/results
    default = tmp_path / "default-results"
    monkeypatch.setattr(harness, "RESULTS_DIR", default)
    threads, dtype = torch.get_num_threads(), torch.get_default_dtype()
    yield tmp_path / "results"
    torch.set_num_threads(threads)
    torch.set_default_dtype(dtype)
    assert not default.exists(), "a smoke run ignored BENCH_RESULTS_DIR; call write_result(name, payload)"


@pytest.mark.parametrize("name", run.discover())
def test_benchmark_smoke_mode_gives_finite_figures(name, isolated):
    path = run.run_one(name, smoke=True)
    assert path == isolated / f"{name}.json"
    body = json.loads(path.read_text())
    assert body["smoke"] is True and isinstance(body.get("config", {}), dict)
    numbers = list(_leaves(body["figures"]))
    assert numbers, f"bench_{name}: no numeric figure in {body['figures']}"
    bad = [(label, value) for label, value in numbers if not math.isfinite(value)]
    assert not bad, f"bench_{name}: non-finite figures {bad}"
    # every side-by-side comparison really timed both sides
    for label, value in numbers:
        if label.endswith(("ours_median_s", "reference_median_s")):
            assert value > 0, f"bench_{name}: {label} = {value}"
    # the table renders every figure of it
    table = run.render_markdown(isolated)
    for label, _ in run._flatten(body["figures"]):
        assert f"| {name} | {label} |" in table
