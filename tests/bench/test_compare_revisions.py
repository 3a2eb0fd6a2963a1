"""bench.compare_revisions: the measurement runs in a fresh process of a tree, and the runner alternates the two
trees and writes medians and after/before speed ratios."""

import json
from pathlib import Path

from bench import compare_revisions

REPO = Path(compare_revisions.__file__).resolve().parents[1]


def test_the_measurement_runs_in_a_fresh_process_of_the_tree():
    figures = compare_revisions.measure(REPO, threads=1, steps=1, new_tokens=4, smoke=True)
    assert set(figures) == {"train_step_s", "text_tokens_per_s", "image_codes_per_s"}
    assert all(value > 0 for value in figures.values())


def test_the_runner_alternates_trees_and_writes_medians_and_ratios(tmp_path, monkeypatch):
    calls = []

    def fake(tree, threads, steps, new_tokens, smoke=False):
        calls.append(Path(tree))
        slower = 2.0 if Path(tree) == REPO else 1.0  # "after" (this checkout) twice as slow
        return {"train_step_s": slower, "text_tokens_per_s": 10 / slower, "image_codes_per_s": 5 / slower}

    monkeypatch.setattr(compare_revisions, "measure", fake)
    out = tmp_path / "revision.json"
    before = tmp_path / "before"
    assert compare_revisions.main(["--before", str(before), "--rounds", "2", "--out", str(out)]) == 0
    assert calls == [before.resolve(), REPO, before.resolve(), REPO]
    ratios = json.loads(out.read_text())["after_over_before_speed"]
    assert ratios == {"train_step_speed": 0.5, "text_decode_speed": 0.5, "image_decode_speed": 0.5}
